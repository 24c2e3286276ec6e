"""Multi-turn tool-use rollouts over any engine, token in, token out.

Each turn, the engine continues every live conversation from its exact token ids so far. When an
assistant turn ends with the end-of-turn token and contains tool calls, the calls run and the tool
response is appended as tokens (``turn = -1``, not model tokens) followed by the next assistant
header; then the next turn is sampled. Model tokens are kept exactly as the engine produced them;
only the tool block is tokenized, once, from text rendered by the model's own chat template.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from mismatch_probe.config.spec import SamplingSpec
from mismatch_probe.engines.base import Engine, GenerationRequest
from mismatch_probe.errors import ConfigError, DataError
from mismatch_probe.rollout.tools import parse_tool_calls, run_tool

_MARK = "\u2063TOOL-RESULT\u2063"


@dataclass(frozen=True)
class ToolTurnTemplate:
    """The text the chat template puts between the model's end-of-turn token and the next
    assistant turn: for ChatML and one tool message, ``\n<|im_start|>tool\n`` + result +
    ``<|im_end|>\n<|im_start|>assistant\n``."""

    before: str  # for one tool message: everything up to its content
    after: str  # and everything after it, through the next assistant header
    after_eos: str  # what the template writes right after the assistant's end-of-turn token
    base: str  # the rendering of _BASE, the prefix every spliced block is cut from

    @classmethod
    def from_tokenizer(cls, tokenizer) -> ToolTurnTemplate:
        eos = tokenizer.eos_token
        try:
            upto = tokenizer.apply_chat_template(_BASE, tokenize=False)
            full = tokenizer.apply_chat_template(
                _BASE + [{"role": "tool", "content": _MARK}], tokenize=False, add_generation_prompt=True
            )
        except Exception as exc:  # any template failure means: no tool role
            raise ConfigError(
                f"the model's chat template cannot render a tool message ({exc})",
                hint="multi-turn tool use needs a chat template with a 'tool' role",
            ) from None
        if not full.startswith(upto) or _MARK not in full or not eos or eos not in upto:
            raise ConfigError(
                "the model's chat template does not render tool turns after the assistant's "
                "end-of-turn token the way mismatch-probe can splice them",
                hint="use a ChatML-style template with a 'tool' role",
            )
        after_eos = upto[upto.rindex(eos) + len(eos) :]
        suffix = full[len(upto) :]
        cut = suffix.index(_MARK)
        return cls(before=after_eos + suffix[:cut], after=suffix[cut + len(_MARK) :], after_eos=after_eos, base=upto)

    def token_ids(self, tokenizer, result: str) -> np.ndarray:
        """One tool message carrying ``result``."""
        return np.asarray(tokenizer.encode(self.before + result + self.after, add_special_tokens=False), np.int32)

    def block_ids(self, tokenizer, messages: list[dict]) -> np.ndarray:
        """Any recorded messages between two assistant turns (tool outputs, a user follow-up), rendered
        by the chat template as it would render them after an assistant turn."""
        full = tokenizer.apply_chat_template(_BASE + messages, tokenize=False, add_generation_prompt=True)
        if not full.startswith(self.base):
            raise ConfigError(
                "the chat template renders earlier turns differently once later messages follow; "
                "recorded turns cannot be spliced token by token"
            )
        return np.asarray(tokenizer.encode(self.after_eos + full[len(self.base) :], add_special_tokens=False), np.int32)


_BASE = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]


@dataclass
class Conversation:
    """One sample being rolled out: parallel per-token arrays, grown turn by turn."""

    sample_id: int
    ids: list[np.ndarray]
    turn: list[np.ndarray]
    model: list[np.ndarray]
    logp: list[np.ndarray]
    experts: list[np.ndarray] = field(default_factory=list)
    finish_reason: str = "length"
    n_tool_calls: int = 0
    # the same conversation as chat messages (assistant turns decoded), for the re-tokenization check
    messages: list[dict] = field(default_factory=list)
    ended_cleanly: bool = False  # its last assistant turn ended with the end-of-turn token

    @classmethod
    def start(cls, sample_id: int, prompt_ids: np.ndarray) -> Conversation:
        n = len(prompt_ids)
        return cls(
            sample_id,
            [prompt_ids.astype(np.int32)],
            [np.full(n, -1, np.int16)],
            [np.zeros(n, bool)],
            [np.full(n, np.nan, np.float32)],
        )

    @property
    def length(self) -> int:
        return sum(len(x) for x in self.ids)

    def token_ids(self) -> np.ndarray:
        return np.concatenate(self.ids)

    def add(self, ids: np.ndarray, turn: int, logp: np.ndarray | None) -> None:
        model = logp is not None
        self.ids.append(ids.astype(np.int32))
        self.turn.append(np.full(len(ids), turn if model else -1, np.int16))
        self.model.append(np.full(len(ids), model, bool))
        self.logp.append(logp.astype(np.float32) if model else np.full(len(ids), np.nan, np.float32))


def roll_out(
    engine: Engine,
    prompts: Sequence[np.ndarray],
    sample_ids: Sequence[int],
    sampling: SamplingSpec,
    *,
    stop_token_ids: Sequence[int],
    seed: int,
    max_turns: int,
    max_model_len: int,
    tokenizer=None,
    template: ToolTurnTemplate | None = None,
    recorded: Sequence[list[list[dict]] | None] | None = None,
    messages: Sequence[list[dict] | None] | None = None,
    server_template: ServerTemplateCheck | None = None,
    on_progress: Callable[[int], None] | None = None,
) -> list[Conversation]:
    """Sample the assistant turns of every conversation (one turn needs no tokenizer).

    A live conversation runs its tool calls for up to ``max_turns`` turns. A recorded one
    (``recorded[i]``: the message blocks between its assistant turns) gets its recorded blocks
    instead, whatever the generated turn said, for as many turns as it recorded.

    ``messages[i]``: the chat prompt ``i``'s ids were rendered from; each request then carries it
    with the turns so far. ``server_template``: the engine renders the messages itself (ms-swift's
    rollout server), so the context it reports is what it sampled from: it is checked against ours
    there, and a conversation continues from the engine's ids.
    """
    convs = [Conversation.start(sid, p) for sid, p in zip(sample_ids, prompts)]
    chats = list(messages) if messages is not None else [None] * len(convs)
    recorded = list(recorded) if recorded is not None else [None] * len(convs)
    limits = [len(r) + 1 if r else max_turns for r in recorded]
    live = list(range(len(convs)))
    stops = {int(t) for t in stop_token_ids}
    for turn in range(max(limits, default=0)):
        n_live = len(live)
        budget = {i: min(sampling.max_tokens, max_model_len - convs[i].length) for i in live}
        for i in [i for i in live if budget[i] < 1]:
            convs[i].finish_reason = "context_full"
        live = [i for i in live if budget[i] >= 1]
        next_live = []
        # in every conversation's last turn the engine reports each sample as it finishes (a remote
        # server's answers arrive one by one); before that, a conversation counts once it ends
        last = all(turn == limits[i] - 1 for i in live)
        if live:
            requests = [
                GenerationRequest(
                    convs[i].token_ids(), budget[i], None if chats[i] is None else chats[i] + convs[i].messages
                )
                for i in live
            ]
            # turn 0 keeps the single-turn seed, so a one-turn probe draws what it always drew
            completions = engine.generate(
                requests,
                sampling,
                stop_token_ids=stop_token_ids,
                seed=seed + turn * 7_919,
                on_progress=on_progress if last else None,
            )
            for i, request, c in zip(live, requests, completions):
                if server_template is not None and not server_template.add(convs[i], request, c, turn, tokenizer):
                    continue  # the engine sampled this turn from a context other than the transcript
                if _extend(convs[i], request, c, turn, turn == limits[i] - 1, stops, tokenizer, template, recorded[i]):
                    next_live.append(i)
        if on_progress:
            on_progress(n_live - len(next_live) - (len(live) if last else 0))
        live = next_live
        if not live:
            break
    return convs


def _extend(
    conv: Conversation,
    request: GenerationRequest,
    c,
    turn: int,
    last_turn: bool,
    stops: set,
    tokenizer,
    template: ToolTurnTemplate | None,
    recorded: list[list[dict]] | None,
) -> bool:
    """Append one sampled turn (and the tool response it asks for); True if the conversation goes on."""
    if (
        c.prompt_token_ids is not None
        and not np.array_equal(c.prompt_token_ids, request.prompt_token_ids)
        and not np.array_equal(c.prompt_token_ids, conv.token_ids())  # the server's rendering, adopted
    ):
        raise DataError(
            f"sample {conv.sample_id}: the engine reports different token ids for turn {turn}'s "
            "context than it was given; the two sides would score different sequences"
        )
    if len(c.logprobs) != len(c.token_ids):
        raise DataError(f"sample {conv.sample_id}: {len(c.token_ids)} tokens but {len(c.logprobs)} log-probs")
    conv.add(c.token_ids, turn, c.logprobs)
    if c.experts is not None:
        conv.experts.append(c.experts)
    conv.finish_reason = c.finish_reason
    ended_turn = c.finish_reason == "stop" and len(c.token_ids) > 0 and int(c.token_ids[-1]) in stops
    conv.ended_cleanly = ended_turn
    if tokenizer is not None:
        body = c.token_ids[:-1] if ended_turn else c.token_ids
        conv.messages.append(
            {"role": "assistant", "content": tokenizer.decode(body.tolist(), skip_special_tokens=False)}
        )
    if not ended_turn or template is None:
        return False
    if recorded is not None:  # replay: the recorded messages follow, whatever this turn said
        if last_turn:
            return False
        conv.add(template.block_ids(tokenizer, recorded[turn]), turn, None)
        conv.messages.extend(recorded[turn])
        return True
    calls = _calls(tokenizer, c.token_ids)
    if not calls:
        return False
    if last_turn:
        conv.finish_reason = "max_turns"  # it asked for a tool, but the turn budget is spent
        return False
    conv.n_tool_calls += len(calls)
    result = "\n".join(run_tool(call) for call in calls)
    conv.add(template.token_ids(tokenizer, result), turn, None)
    conv.messages.append({"role": "tool", "content": result})
    return True


@dataclass
class ServerTemplateCheck:
    """The prompt ids a server that renders chat messages itself (ms-swift's ``swift rollout``,
    its own template) reports against ours (the checkpoint's chat template, as a trainer that
    re-encodes the prompt renders it). A difference is a mismatch source of its own, so it is a
    finding, not an error: the probe scores what the server saw. In a conversation's first turn
    the server's ids replace ours; in a later turn (the server re-renders the whole conversation,
    earlier turns decoded to text) a different context ends the conversation before that turn, as
    the turn's tokens were not sampled after the transcript both sides score."""

    n_turns: int = 0  # contexts compared
    n_differing: int = 0
    n_prompts: int = 0  # first turns compared
    n_prompts_differing: int = 0
    n_cut: int = 0  # conversations ended before a later turn whose context differed
    examples: list[dict] = field(default_factory=list)

    def add(self, conv: Conversation, request: GenerationRequest, c, turn: int, tokenizer) -> bool:
        """Check one turn's context; False: the conversation ends before this turn."""
        ours, theirs = request.prompt_token_ids, c.prompt_token_ids
        if theirs is None:
            raise DataError(f"sample {conv.sample_id}: the server did not report the prompt ids it rendered")
        self.n_turns += 1
        self.n_prompts += turn == 0
        same = np.array_equal(ours, theirs)
        if not same:
            self.n_differing += 1
            self.n_prompts_differing += turn == 0
            if len(self.examples) < 5:
                self.examples.append(_first_difference(conv.sample_id, turn, ours, theirs, tokenizer))
        if same or turn > 0:
            if not same:
                self.n_cut += 1
                conv.finish_reason = "context_differs"
            return same
        n = len(theirs)  # the first turn: the server's rendering is the prompt
        conv.ids[0] = theirs.astype(np.int32)
        conv.turn[0] = np.full(n, -1, np.int16)
        conv.model[0] = np.zeros(n, bool)
        conv.logp[0] = np.full(n, np.nan, np.float32)
        return True

    def merge(self, previous: dict | None) -> dict:
        """run.json's ``server_template_check``: this invocation's counts added to an earlier one's."""
        prev = previous or {}
        out = {
            key: getattr(self, key) + int(prev.get(key, 0))
            for key in ("n_turns", "n_differing", "n_prompts", "n_prompts_differing", "n_cut")
        }
        out["share_differing"] = out["n_differing"] / out["n_turns"] if out["n_turns"] else None
        out["examples"] = ((prev.get("examples") or []) + self.examples)[:5]
        return out


def _first_difference(sample_id: int, turn: int, ours: np.ndarray, theirs: np.ndarray, tokenizer) -> dict:
    n = min(len(ours), len(theirs))
    diff = np.flatnonzero(ours[:n] != theirs[:n])
    at = int(diff[0]) if len(diff) else n
    example = {
        "sample_id": sample_id,
        "turn": turn,
        "first_difference_at": at,
        "tokens_ours": len(ours),
        "tokens_server": len(theirs),
        "ours": [int(t) for t in ours[at : at + 8]],
        "server": [int(t) for t in theirs[at : at + 8]],
    }
    if tokenizer is not None:  # what a person reads: the text from a little before the difference
        lo = max(0, at - 4)
        example["ours_text"] = tokenizer.decode(ours[lo : at + 8].tolist(), skip_special_tokens=False)
        example["server_text"] = tokenizer.decode(theirs[lo : at + 8].tolist(), skip_special_tokens=False)
    return example


@dataclass
class RetokenizationCheck:
    """Transcript ids against a fresh tokenization of the same chat through the chat template.

    A difference means a trainer that re-tokenizes the conversation text would score other token
    ids than the engine sampled: a silent source of mismatch in multi-turn RL.
    """

    n_checked: int = 0
    n_differing: int = 0
    n_unchecked: int = 0  # no chat messages, or the last turn was cut off (its text has no end)
    examples: list[dict] = field(default_factory=list)

    def add(self, conv: Conversation, prompt_messages: list[dict] | None, tokenizer) -> None:
        if not prompt_messages or not conv.ended_cleanly or tokenizer is None:
            self.n_unchecked += 1
            return
        text = tokenizer.apply_chat_template(prompt_messages + conv.messages, tokenize=False)
        fresh = np.asarray(tokenizer.encode(text, add_special_tokens=False), np.int64)
        ids = conv.token_ids().astype(np.int64)
        self.n_checked += 1
        n = min(len(ids), len(fresh))
        diff = np.flatnonzero(ids[:n] != fresh[:n])
        # the template closes the last assistant turn after its end-of-turn token; that tail is not a difference
        if len(diff) == 0 and len(fresh) >= len(ids):
            return
        self.n_differing += 1
        if len(self.examples) < 5:
            self.examples.append(
                {
                    "sample_id": conv.sample_id,
                    "first_difference_at": int(diff[0]) if len(diff) else n,
                    "transcript_tokens": len(ids),
                    "retokenized_tokens": len(fresh),
                }
            )

    def merge(self, previous: dict | None) -> dict:
        prev = previous or {}
        return {
            "n_checked": self.n_checked + prev.get("n_checked", 0),
            "n_differing": self.n_differing + prev.get("n_differing", 0),
            "n_unchecked": self.n_unchecked + prev.get("n_unchecked", 0),
            "examples": (prev.get("examples") or []) + self.examples,
        }


def _calls(tokenizer, token_ids: np.ndarray):
    return parse_tool_calls(tokenizer.decode(token_ids.tolist(), skip_special_tokens=False))
