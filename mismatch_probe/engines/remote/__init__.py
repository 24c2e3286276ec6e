"""The ``remote`` engine: a rollout server that is already running, over HTTP (``engine.url``).

RL setups that sample out of process (slime, ms-swift's external mode, TRL's server mode, a server
of one's own) talk to a vLLM or SGLang server, and that server, with its own flags, build and GPU,
is what causes the mismatch. This engine probes it as it runs instead of re-creating it in process.

``engine.py`` is the engine, the same for every server; each dialect (``engine.api``) is a module
of its own beside it (``openai.py``: ``vllm serve``; ``sglang.py``; ``swift.py``: ms-swift's ``swift
rollout``; ``trl.py``: TRL's ``trl vllm-serve``), a :class:`~mismatch_probe.engines.remote.dialect.Dialect`
listed by one line in ``config/remote_dialects.py`` and imported only when a run talks to such a
server. A dialect holds its routes, its request and answer codec, what it reads back of the server,
its log-probs' semantics and its weight-sync facts and operations, and reaches the server through
``dialect.Session``.

Nothing is re-tokenized (a swift server's prompt ids are its own): a server that answers with text
only is refused with the option that turns ids on. The server's settings are read back wherever it
exposes them; every setting it does not expose is recorded as unknown, with what would expose it,
never guessed. The served model must be the checkpoint the reference loads (names, architectures,
and the server's tokenizer on a probe text where it has one), unless ``engine.check_model = false``.

Weight sync (``[sync]``, ARCHITECTURE.md, Weight sync) goes through the server's own HTTP routes, as
an RL trainer that talks to a rollout server does (each dialect declares what its server can take,
``Dialect.capabilities``, and ``engines/base.py: check_sync`` refuses the rest before any request). After each sync the journal of answers starts a new epoch,
so an answer given before a sync is never reused after it.
"""

from mismatch_probe.engines.remote.engine import RemoteEngine, check_spec, check_sync, server_changes

__all__ = ["RemoteEngine", "check_spec", "check_sync", "server_changes"]
