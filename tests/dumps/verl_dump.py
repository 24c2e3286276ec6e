"""Save a rollout cache with verl's own DataProto (run with verl on PYTHONPATH: install-verl.sh).

    python verl_dump.py ARRAYS.npz UIDS.json OUT/gen_batch.dp [ARRAYS.npz UIDS.json OUT/gen_batch.dp ...]

ARRAYS holds the batch's tensors as the agent loop pads them (training_run.write_verl); this wraps
them in verl's DataProto exactly as AgentLoopManager returns it and saves it with verl's
save_to_disk, the call RolloutSkip makes.
"""

import json
import sys
from pathlib import Path

import numpy as np
import torch
from verl.protocol import DataProto


def save(arrays_path: str, uids_path: str, out_path: str) -> None:
    arrays, uids, out = np.load(arrays_path), json.loads(Path(uids_path).read_text()), Path(out_path)
    tensors = {k: torch.from_numpy(arrays[k]) for k in arrays.files if k != "__num_turns__"}
    uid = np.empty(len(uids), dtype=object)
    uid[:] = uids
    non_tensors = {"uid": uid, "__num_turns__": arrays["__num_turns__"]}
    meta = {"timing": {"generate_sequences": np.float64(1.5)}, "reward_extra_keys": []}
    out.parent.mkdir(parents=True, exist_ok=True)
    DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta).save_to_disk(out)


if __name__ == "__main__":
    triples = sys.argv[1:]
    if not triples or len(triples) % 3:
        raise SystemExit("usage: verl_dump.py ARRAYS.npz UIDS.json OUT/gen_batch.dp [...]")
    for k in range(0, len(triples), 3):  # several steps in one process: verl's import costs seconds
        save(*triples[k : k + 3])
