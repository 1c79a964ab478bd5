"""A stand-in for an OpenAI-compatible server with speculative decoding, for the bench's server mode.

    python tests/fake_server.py PORT [--tau T] [--api openai|sglang] [--fail-start]

Answers `max_tokens` tokens of text for every request (the token ids "generated" are counted, the text
is "ok " repeated) after a delay proportional to them, and keeps vLLM's Prometheus spec-decode
counters as if every verify step committed exactly T tokens (T = 1: no drafter, no counters); with
--api sglang it serves SGLang's native /generate with `spec_verify_ct` instead. Records the prompts it
was sent in a JSON list at /prompts, so a test can check what the bench sent.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("port", type=int)
    p.add_argument("--tau", type=float, default=1.0)
    p.add_argument("--api", default="openai", choices=["openai", "sglang"])
    p.add_argument("--fail-start", action="store_true", help="exit at once with an error")
    p.add_argument("--record", help="append one line per generation request: its arrival time")
    args = p.parse_args()
    if args.fail_start:
        print("fake server: refusing to start", flush=True)
        return 3
    state = dict(drafts=0, accepted=0, per_pos=[0] * 15, prompts=[])
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):  # quiet
            pass

        def _send(self, body, kind="application/json"):
            data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                return self._send("")
            if self.path == "/v1/models":
                return self._send({"data": [{"id": "fake-model"}]})
            if self.path == "/version":
                return self._send({"version": "fake-1"})
            if self.path == "/prompts":
                with lock:
                    return self._send(state["prompts"])
            if self.path == "/metrics" and args.api == "openai" and args.tau > 1:
                with lock:
                    lines = [f'vllm:spec_decode_num_drafts_total{{engine="0"}} {float(state["drafts"])}',
                             f'vllm:spec_decode_num_accepted_tokens_total{{engine="0"}} {float(state["accepted"])}']
                    lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",position="{i}"}} {float(v)}'
                              for i, v in enumerate(state["per_pos"])]
                return self._send("# HELP fake\n" + "\n".join(lines) + "\n", "text/plain")
            self.send_response(404)
            self.end_headers()

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if args.api == "openai" and self.path == "/v1/completions":
                prompt, n = body["prompt"], int(body["max_tokens"])
            elif args.api == "sglang" and self.path == "/generate":
                prompt, n = body["input_ids"], int(body["sampling_params"]["max_new_tokens"])
            else:
                self.send_response(404)
                self.end_headers()
                return
            steps = math.ceil(n / args.tau)
            if args.record:
                with open(args.record, "a") as log:
                    log.write(f"{time.time()}\n")
            with lock:
                state["prompts"].append(prompt)
                if args.tau > 1:  # every step commits tau tokens: tau - 1 accepted drafts
                    state["drafts"] += steps
                    state["accepted"] += round(steps * (args.tau - 1))
                    for i in range(int(args.tau) - 1):
                        state["per_pos"][i] += steps
            time.sleep(0.002 * steps)
            text = "ok " * n
            if args.api == "openai":
                return self._send({"choices": [{"text": text}], "usage": {"completion_tokens": n}})
            return self._send({"text": text, "meta_info": {"completion_tokens": n, "spec_verify_ct": steps}})

    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    print(f"fake server on 127.0.0.1:{args.port}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
