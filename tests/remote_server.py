"""A scripted OpenAI-completions server for the remote engine's fault tests (not a model).

    python tests/remote_server.py --port 0 [--fail-attempts N] [--hang-attempts N --hang-s S]
        [--throttle-attempts N] [--die-after N] [--api-key KEY] [--model NAME] [--root PATH]
        [--text-only] [--swift [--swift-tokenizer DIR] [--swift-default-system TEXT]
        [--swift-multi-turn-scheduler]] [--trl-serve] [--sglang-router] [--tls-cert PEM --tls-key PEM] [--latency-s S]

It prints ``PORT <n>`` once it listens. It speaks the parts of vLLM's API the remote engine uses
(``/v1/models``, ``/version``, ``/v1/completions`` with token-id prompts, ``return_token_ids``,
``return_tokens_as_token_ids``, ``prompt_logprobs``) and answers deterministically: a request's
tokens and log-probs are a function of its body (prompt, seed, settings), so a re-sent request
gets the same answer, as from a seeded server. Faults are per request body: its first N attempts
fail with 500 (``--fail-attempts``), 429 (``--throttle-attempts``) or hang past the client's
timeout (``--hang-attempts``); ``--die-after N`` kills the process (no answer, no goodbye) when
the N+1-th completion is asked for. ``GET /stats`` reports the attempts and answers so far.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np

VOCAB = 1000  # within the fixture model's vocabulary


def rng_for(body: dict) -> np.random.Generator:
    key = {k: v for k, v in body.items() if k != "model"}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little"))


def completion(body: dict, text_only: bool) -> dict:
    prompt = body["prompt"]
    choice: dict = {"index": 0, "text": "", "stop_reason": None}
    if body.get("prompt_logprobs") is not None:
        # each position's log-prob depends on the prefix only, as a model's would
        entries: list = [None]
        for p in range(1, len(prompt)):
            h = hashlib.sha256(json.dumps(prompt[: p + 1]).encode()).digest()
            entries.append({str(prompt[p]): {"logprob": -(h[0] + h[1] / 256) / 40, "rank": 1, "decoded_token": "x"}})
        choice.update(prompt_logprobs=entries, finish_reason="length", logprobs=None, token_ids=None)
        return {"choices": [choice]}
    rng = rng_for(body)
    stops = body.get("stop_token_ids") or []
    n = int(rng.integers(1, body["max_tokens"] + 1))
    tokens = [int(t) for t in rng.integers(3, VOCAB, n)]
    finish = "length" if n == body["max_tokens"] else "stop"
    if finish == "stop" and stops:
        tokens[-1] = int(stops[0])
    logprobs = [float(-rng.exponential(1.0)) for _ in tokens]
    names = [f"tok{t}" if text_only else f"token_id:{t}" for t in tokens]
    choice.update(
        finish_reason=finish,
        logprobs={
            "tokens": names,
            "token_logprobs": logprobs,
            "top_logprobs": [{k: v} for k, v in zip(names, logprobs)],
        },
        token_ids=None if text_only else tokens,
        prompt_token_ids=None if text_only else prompt,
    )
    return {"choices": [choice]}


def sglang_generate(body: dict) -> dict:
    """The same answers in SGLang's /generate format (a router in front of workers: no /server_info)."""
    ids, params = body["input_ids"], body["sampling_params"]
    if params.get("max_new_tokens") == 0:  # a prefill re-score from logprob_start_len
        start = body["logprob_start_len"]
        entries = completion({"prompt": ids, "prompt_logprobs": 0}, False)["choices"][0]["prompt_logprobs"]
        scored = [[None, ids[start], None]] + [
            [entries[p][str(ids[p])]["logprob"], ids[p], None] for p in range(start + 1, len(ids))
        ]
        return {"output_ids": [], "meta_info": {"input_token_logprobs": scored, "finish_reason": {"type": "length"}}}
    as_openai = {
        "prompt": ids,
        "max_tokens": params["max_new_tokens"],
        "stop_token_ids": params.get("stop_token_ids"),
        "seed": params.get("sampling_seed"),
        "temperature": params.get("temperature"),
    }
    choice = completion(as_openai, False)["choices"][0]
    tokens, logprobs = choice["token_ids"], choice["logprobs"]["token_logprobs"]
    return {
        "output_ids": tokens,
        "meta_info": {
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, tokens)],
            "finish_reason": {"type": choice["finish_reason"]},
        },
    }


def swift_infer(body: dict, tokenizer, default_system: str | None) -> list[dict]:
    """ms-swift's ``POST /infer/`` (swift/pipelines/infer/rollout.py: SwiftRolloutDeploy.infer), field
    for field as its protocol classes (swift/infer_engine/protocol.py: RolloutInferRequest and
    RequestConfig in, a list of RolloutOutput out): each request's messages rendered with the chat
    template (as ``--template_backend jinja``; ``default_system`` as a swift template's own default
    system prompt, added when the chat has none), then the same deterministic answers as /v1/completions."""
    config = body.get("request_config") or {}
    outputs = []
    for request in body["infer_requests"]:
        messages = request["messages"]
        if default_system is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": default_system}, *messages]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompt = tokenizer.encode(text, add_special_tokens=False)
        as_openai = {
            "prompt": prompt,
            "max_tokens": config.get("max_tokens") or 16,
            "stop_token_ids": [tokenizer.convert_tokens_to_ids("<|im_end|>")],
            "seed": config.get("seed"),
            "temperature": config.get("temperature"),
        }
        choice = completion(as_openai, False)["choices"][0]
        tokens, logprobs = choice["token_ids"], choice["logprobs"]["token_logprobs"]
        details = bool(config.get("return_details"))
        response = {
            "model": "tiny-qwen2",
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": tokenizer.decode(tokens, skip_special_tokens=True),
                        "tool_calls": None,
                        "reasoning_content": None,
                    },
                    "finish_reason": choice["finish_reason"],
                    "logprobs": {
                        "content": [
                            {
                                "token": tokenizer.decode([t]),
                                "logprob": lp,
                                "bytes": list(tokenizer.decode([t]).encode()),
                            }
                            for t, lp in zip(tokens, logprobs)
                        ]
                    }
                    if config.get("logprobs")
                    else None,
                    "token_ids": tokens if details else None,
                    "routed_experts": None,
                }
            ],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(tokens),
                "total_tokens": len(prompt) + len(tokens),
            },
            "id": "0",
            "object": "chat.completion",
            "created": 1760000000,
            "prompt_token_ids": prompt if details else None,
            "prompt_logprobs": None,
            "images_size": None,
        }
        outputs.append(
            {
                "response": response,
                "messages": None,
                "response_token_ids": [],
                "response_loss_mask": [],
                "rollout_infos": {},
                "rollout_logprobs": [],
                "prompt_logprobs": None,
            }
        )
    return outputs


class State:
    def __init__(self, args):
        self.args = args
        self.lock = threading.Lock()
        self.attempts: dict[str, int] = {}
        self.answered = 0
        self.total_attempts = 0
        self.auth_failures = 0
        self.tokenizer = None
        if args.swift_tokenizer:  # what renders a swift server's chat messages
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(args.swift_tokenizer)

    def attempt(self, body: dict) -> int:
        key = json.dumps(body, sort_keys=True)
        with self.lock:
            self.total_attempts += 1
            self.attempts[key] = self.attempts.get(key, 0) + 1
            return self.attempts[key]


def make_handler(state: State):
    args = state.args

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # headers and body go out in two writes: no 40 ms delayed-ACK stall

        def log_message(self, *a):  # quiet
            pass

        def _send(self, status: int, payload, headers: dict | None = None) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)

        def _authorized(self) -> bool:
            if args.api_key and self.headers.get("Authorization") != f"Bearer {args.api_key}":
                state.auth_failures += 1
                self._send(401, {"error": {"message": "Unauthorized", "type": "auth"}})
                return False
            return True

        def do_GET(self):
            path = self.path.split("?")[0]
            if path == "/stats":  # the test's own view, outside the API
                stats = {"answered": state.answered, "attempts": state.total_attempts, "auth": state.auth_failures}
                self._send(200, stats)
                return
            if not self._authorized():
                return
            if args.sglang_router:
                self._send(200, {}) if path == "/health" else self._send(404, {"detail": "Not Found"})
                return
            if args.swift or args.trl_serve:  # ms-swift's `swift rollout`, TRL's `trl vllm-serve`: no OpenAI routes
                if path == "/get_world_size/":
                    self._send(200, {"world_size": 1})
                elif path == "/health/":
                    self._send(200, {"status": "ok"})
                else:
                    self._send(404, {"detail": "Not Found"})
                return
            if path == "/v1/models":
                root = args.root or args.model
                self._send(200, {"object": "list", "data": [{"id": args.model, "root": root, "max_model_len": 1024}]})
            elif path == "/version":
                self._send(200, {"version": args.version})
            else:
                self._send(404, {"detail": "Not Found"})

        def do_POST(self):
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            if not self._authorized():
                return
            if args.sglang_router and self.path == "/generate":
                state.attempt(body)
                self._send(200, sglang_generate(body))
                return
            if args.trl_serve:  # its /generate/ and weight routes only: no /get_engine_type/
                self._send(404, {"detail": "Not Found"})
                return
            if args.swift:
                path = self.path.split("?")[0]
                if path == "/get_engine_type/":
                    multi = args.swift_multi_turn_scheduler
                    self._send(
                        200,
                        {
                            "engine_type": "AsyncLLMEngine" if multi else "LLMEngine",
                            "enable_multi_turn": multi,
                            "use_gym_env": False,
                            "enable_lora": False,
                        },
                    )
                elif path == "/infer/" and state.tokenizer is not None:
                    state.attempt(body)
                    with state.lock:
                        state.answered += 1
                    self._send(200, swift_infer(body, state.tokenizer, args.swift_default_system))
                else:
                    self._send(404, {"detail": "Not Found"})
                return
            if self.path != "/v1/completions":
                self._send(404, {"detail": "Not Found"})
                return
            if body.get("model") != args.model:
                self._send(404, {"error": {"message": f"The model `{body.get('model')}` does not exist."}})
                return
            attempt = state.attempt(body)
            if attempt <= args.throttle_attempts:
                self._send(429, {"error": {"message": "Too many requests"}}, {"Retry-After": "0"})
                return
            if attempt <= args.fail_attempts:
                self._send(500, {"error": {"message": f"scripted failure {attempt}"}})
                return
            if attempt <= args.hang_attempts:
                time.sleep(args.hang_s)
            with state.lock:
                dying = args.die_after is not None and state.answered >= args.die_after
                if not dying:
                    state.answered += 1
            if dying:
                time.sleep(0.3)  # the answers already given reach the client (a test counts them)
                os._exit(1)  # as a killed server: the connection drops, nothing more is answered
            time.sleep(args.latency_s)
            self._send(200, completion(body, args.text_only))

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--model", default="tiny-qwen2")
    parser.add_argument("--root", default=None)
    parser.add_argument("--version", default="0.0.0-scripted", help="what /version says")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--fail-attempts", type=int, default=0)
    parser.add_argument("--throttle-attempts", type=int, default=0)
    parser.add_argument("--hang-attempts", type=int, default=0)
    parser.add_argument("--hang-s", type=float, default=5.0)
    parser.add_argument("--die-after", type=int, default=None)
    parser.add_argument("--latency-s", type=float, default=0.0)
    parser.add_argument("--text-only", action="store_true")
    parser.add_argument("--swift", action="store_true", help="answer as ms-swift's `swift rollout` server")
    parser.add_argument("--swift-tokenizer", default=None, help="answer /infer/, rendering with this tokenizer")
    parser.add_argument("--swift-default-system", default=None, help="a system prompt the template adds")
    parser.add_argument("--swift-multi-turn-scheduler", action="store_true", help="say it runs a scheduler")
    parser.add_argument("--trl-serve", action="store_true", help="answer as TRL's `trl vllm-serve` server")
    parser.add_argument("--sglang-router", action="store_true", help="answer /generate as an SGLang router")
    parser.add_argument("--tls-cert", default=None, help="serve HTTPS with this certificate (PEM)")
    parser.add_argument("--tls-key", default=None, help="its private key (PEM)")
    args = parser.parse_args()
    ThreadingHTTPServer.request_queue_size = 512  # the client opens up to max_concurrency connections at once
    server = ThreadingHTTPServer(("127.0.0.1", args.port), make_handler(State(args)))
    server.daemon_threads = True
    if args.tls_cert:  # HTTPS with the given certificate (the TLS test's self-signed one)
        import ssl

        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(args.tls_cert, args.tls_key)
        server.socket = context.wrap_socket(server.socket, server_side=True)
    print(f"PORT {server.server_address[1]}", flush=True)
    sys.stdout.flush()
    server.serve_forever()


if __name__ == "__main__":
    main()
