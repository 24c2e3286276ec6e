"""The remote engine's client against the scripted server (tests/remote_server.py), one run:

    python benchmarks/bench_remote.py [--requests 512] [--latency-ms 20] [--tokens 64]

- throughput against a server that takes ``--latency-ms`` per request (a stand-in for generation),
  at 1, 8, 32 and 128 requests in flight, as a share of the ideal (requests x latency / concurrency);
- the client's own CPU per answer (this process's CPU time over a zero-latency run: sending,
  parsing the JSON, turning it into a Completion, journaling), with and without the journal;
- a resume: reading a journal of ``--requests`` answers back, and a run that finds every answer in
  it (nothing sent).

The server is a Python thread-per-request process on the same machine, so absolute rates are its,
not a GPU server's; the ratios are the client's.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import smoke  # benchmarks/smoke.py: the --smoke flag
from remote_fixtures import scripted_server

from mismatch_probe.config.spec import SamplingSpec
from mismatch_probe.engines.base import GenerationRequest
from mismatch_probe.engines.http_client import Client, Journal
from mismatch_probe.engines.remote.openai import OpenAIDialect

SMOKE = {"requests": 16, "latency_ms": 1.0, "tokens": 8}


def run(url: str, n: int, tokens: int, concurrency: int, journal: Journal | None, offset: int) -> tuple[float, float]:
    """Wall and this process's CPU seconds to sample ``n`` requests (prompts offset so none repeats)."""
    dialect = OpenAIDialect()
    sampling = SamplingSpec(temperature=1.0, top_p=1.0, top_k=0, max_tokens=tokens)
    requests = [GenerationRequest(np.array([1, 7, offset + i % 900, i], np.int32), tokens) for i in range(n)]
    bodies = [dialect.generate_body("tiny-qwen2", r, sampling, [2], i) for i, r in enumerate(requests)]
    client = Client(url=url, max_concurrency=concurrency, backoff_s=0.05, log=lambda m: None)
    parsed = []
    wall, cpu = time.perf_counter(), time.process_time()
    client.post_all(
        "/v1/completions",
        bodies,
        what=str,
        journal=journal,
        on_answer=lambda i, a: parsed.append(dialect.completion(a, requests[i], "bench")),
    )
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    assert len(parsed) == n
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--tokens", type=int, default=64)
    smoke.add_flag(parser)
    args = parser.parse_args()
    if args.smoke:
        vars(args).update(SMOKE)
    n, latency = args.requests, args.latency_ms / 1000
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        print(f"{n} requests of up to {args.tokens} tokens; server latency {args.latency_ms:g} ms a request")
        with scripted_server(tmp_path, "--latency-s", str(latency)) as server:
            for c in (1, 8, 32, 128):
                count = min(n, 64) if c == 1 else n  # sequential: a subset, scaled
                wall, _ = run(server.url, count, args.tokens, c, None, offset=10 * c)
                ideal = count * latency / c
                print(
                    f"  concurrency {c:>3}: {count / wall:7.1f} requests/s, "
                    f"{ideal / wall:5.2f} of the ideal {count / ideal:7.1f}"
                )
        with scripted_server(tmp_path) as server:
            run(server.url, 64, args.tokens, 32, None, offset=3)  # warm-up (imports, first connections)
            _, plain = run(server.url, n, args.tokens, 32, None, offset=5)
            journal = Journal(tmp_path / "journal")
            _, journaled = run(server.url, n, args.tokens, 32, journal, offset=7)
            journal.close()
            print(
                f"  client CPU per answer: {plain / n * 1e3:.2f} ms without the journal, "
                f"{journaled / n * 1e3:.2f} ms with it ({journaled / plain:.2f}x)"
            )
            t = time.perf_counter()
            reread = Journal(tmp_path / "journal")
            read_s = time.perf_counter() - t
            size = (tmp_path / "journal" / "received.jsonl").stat().st_size
            wall, _ = run(server.url, n, args.tokens, 32, reread, offset=7)
            attempts = server.stats()["attempts"]
            print(
                f"  resume: reading {len(reread)} answers ({size / 2**20:.1f} MiB) {read_s * 1e3:.0f} ms; "
                f"the run that finds them all {wall * 1e3:.0f} ms, {attempts - 64 - 2 * n} requests sent"
            )


if __name__ == "__main__":
    main()
