"""A generator process with its own copy of the weights that speaks the weight-sync protocol (train/weight_sync.py)
on the CPU: what the vLLM back-end's server is to the trainer, with transformers doing the generating.

    python -m shardtune.train.protocol_generator --model DIR --dtype float32     (the authkey on stdin, one hex line)

It loads the model folder into a transformers model of its own, listens on loopback (``multiprocessing.connection``,
authenticated by a key only the trainer's ranks get) and prints ``listening HOST PORT``. Every rank connects one
``GeneratorClient``; rank 0 streams the weights into it, every rank may ask it for completions. Messages, and what
they are on a vLLM server (TRL's ``VLLMClient``, trl/generation/vllm_client.py):

* ``("load", [(name, dtype, shape, bytes), ...])``: one bucket; ``update_named_params`` (metadata, then the NCCL
  broadcast of the tensors) -> the workers' ``model.load_weights(list of (name, tensor))``. A name that is not
  the model's, or another shape, is an error (vLLM's ``load_weights`` would raise too).
* ``("finish",)``: the sync is complete; ``reset_prefix_cache`` (cached prefixes hold the old weights' keys).
* ``("generate", prompt ids, n, sampling, row, stop ids, pad id)``: ``n`` completions with their log-probabilities,
  seeded by the row as the transformers back-end seeds them (train/rollout.py); vLLM's ``generate`` with ``n``,
  ``seed`` and ``logprobs=0``.
* ``("digest",)``: sha256 of every tensor of its state dict (no vLLM counterpart: the proof's probe).

The process ends when its parent's pipe on its stdin closes (``GeneratorProcess.stop``, or the parent's death).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import hashlib
import os
import subprocess
import sys
import threading
import traceback
from dataclasses import asdict, dataclass
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import Any

import torch

from shardtune.engines.base import Engine
from shardtune.train.rollout import Completions, Sampling, row_seed, sampled_completions

Wire = tuple[str, str, list[int], bytes]


def encode(name: str, tensor: torch.Tensor) -> Wire:
    """A tensor as the protocol sends it: name, dtype as vLLM spells it (``bfloat16``), shape, raw bytes."""
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), raw


def decode(wire: Wire) -> tuple[str, torch.Tensor]:
    name, dtype, shape, raw = wire
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return name, flat.view(getattr(torch, dtype)).reshape(shape)


def tensor_digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(encode("", tensor)[3]).hexdigest() + f":{tensor.dtype}:{list(tensor.shape)}"


class ProtocolGenerator:
    """The server's model: loads buckets, generates, reports digests (one request at a time)."""

    def __init__(self, model_dir: str, dtype: torch.dtype) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        self.params = dict(self.model.named_parameters())
        self.lock = threading.Lock()
        self.loaded = 0

    def load_weights(self, bucket: list[Wire]) -> int:
        with self.lock, torch.no_grad():
            for wire in bucket:
                name, tensor = decode(wire)
                target = self.params.get(name)
                if target is None or target.shape != tensor.shape or target.dtype != tensor.dtype:
                    found = "no such weight" if target is None else f"{target.dtype} {list(target.shape)}"
                    raise ValueError(f"weight {name} ({tensor.dtype} {list(tensor.shape)}): the generator has {found}")
                target.copy_(tensor)
                self.loaded += 1
        return len(bucket)

    def digest(self) -> dict[str, str]:
        with self.lock:
            return {name: tensor_digest(t) for name, t in self.model.state_dict().items()}

    def generate(self, prompt_ids: list[int], n: int, sampling: dict[str, Any], row: int, stop_ids: list[int],
                 pad: int) -> dict[str, Any]:
        s = Sampling(**sampling)
        prompt = torch.tensor([prompt_ids] * n, dtype=torch.long)
        with self.lock, torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(row_seed(s.seed, row))
            out = self.model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=True,
                                      temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                      max_new_tokens=s.max_completion_length, eos_token_id=stop_ids,
                                      pad_token_id=pad, return_dict_in_generate=True, output_logits=True)
        done = sampled_completions(out, len(prompt_ids), stop_ids, pad, s.temperature)
        assert done.logps is not None
        return {"ids": done.ids.tolist(), "mask": done.mask.tolist(), "truncated": done.truncated.tolist(),
                "logps": done.logps.tolist()}


def handle(generator: ProtocolGenerator, message: tuple) -> Any:
    kind, *args = message
    if kind == "load":
        return generator.load_weights(args[0])
    if kind == "finish":
        return generator.loaded
    if kind == "generate":
        return generator.generate(*args)
    if kind == "digest":
        return generator.digest()
    raise ValueError(f"unknown message {kind!r}")


def serve_connection(generator: ProtocolGenerator, conn: Connection) -> None:
    with conn:
        while True:
            try:
                message = conn.recv()
            except EOFError:
                return
            try:
                conn.send(("ok", handle(generator, message)))
            except Exception:  # noqa: BLE001 - the client raises it with the server's traceback
                conn.send(("error", traceback.format_exc()))


def serve(model_dir: str, dtype: torch.dtype, authkey: bytes) -> None:
    """Accept clients (a thread each) until stdin, the parent's pipe, closes."""
    generator = ProtocolGenerator(model_dir, dtype)
    listener = Listener(("127.0.0.1", 0), authkey=authkey)
    host, port = listener.address

    def accept_forever() -> None:
        while True:
            conn = listener.accept()
            threading.Thread(target=serve_connection, args=(generator, conn), daemon=True).start()

    threading.Thread(target=accept_forever, daemon=True).start()
    print(f"listening {host} {port}", flush=True)
    sys.stdin.read()
    listener.close()


def connect_generator(engine: Engine, model_dir: str | Path, dtype: torch.dtype, stop_ids: list[int],
                      pad_token_id: int) -> tuple[GeneratorClient, GeneratorProcess | None]:
    """Rank 0 starts the generator process; every rank connects to it (its address and key travel over the
    process group, never through the environment). A collective."""
    started = GeneratorProcess(model_dir, dtype) if engine.is_main else None
    address = engine.gather_objects(started.address if started is not None else None)[0]
    return GeneratorClient(address, dtype, stop_ids, pad_token_id), started


@dataclass(frozen=True)
class GeneratorAddress:
    host: str
    port: int
    authkey: bytes


class GeneratorClient:
    """One rank's connection: a ``WeightReceiver`` (rank 0 streams the sync into it) and a ``Rollout``."""

    def __init__(self, address: GeneratorAddress, dtype: torch.dtype, stop_ids: list[int], pad_token_id: int) -> None:
        self.conn = Client((address.host, address.port), authkey=address.authkey)
        self.dtype = dtype
        self.stop_ids, self.pad_token_id = stop_ids, pad_token_id

    def call(self, *message: Any) -> Any:
        self.conn.send(message)
        status, value = self.conn.recv()
        if status == "error":
            raise RuntimeError(f"generator process: {value.strip().splitlines()[-1]}\n{value}")
        return value

    def load_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        self.call("load", [encode(name, tensor) for name, tensor in named])

    def finish_weight_update(self) -> None:
        self.call("finish")

    def generate(self, prompt_ids: list[int], n: int, sampling: Sampling, row: int) -> Completions:
        out = self.call("generate", list(prompt_ids), n, asdict(sampling), row, self.stop_ids, self.pad_token_id)
        return Completions(torch.tensor(out["ids"], dtype=torch.long), torch.tensor(out["mask"], dtype=torch.long),
                           torch.tensor(out["truncated"], dtype=torch.bool), torch.tensor(out["logps"]))

    def digest(self) -> dict[str, str]:
        return self.call("digest")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.close()


class GeneratorProcess:
    """The generator started as a child of this process (rank 0's)."""

    def __init__(self, model_dir: str | Path, dtype: torch.dtype, threads: int = 1) -> None:
        authkey = os.urandom(32)
        argv = [sys.executable, "-m", "shardtune.train.protocol_generator", "--model", str(model_dir), "--dtype",
                str(dtype).removeprefix("torch."), "--threads", str(threads)]
        self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(authkey.hex() + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline().split()
        if line[:1] != ["listening"]:
            self.stop()
            raise RuntimeError(f"generator process for {model_dir} did not start (exit code {self.process.poll()})")
        self.address = GeneratorAddress(line[1], int(line[2]), authkey)
        # Stopped when the rank ends (leave_rank runs the exit handlers), not left to notice its closed stdin after
        # the rank is gone: a launcher that ends the job right then would find it still running.
        atexit.register(self.stop)

    def stop(self) -> None:
        if self.process.stdin is not None:
            with contextlib.suppress(OSError):
                self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    authkey = bytes.fromhex(sys.stdin.readline().strip())
    serve(args.model, getattr(torch, args.dtype), authkey)


if __name__ == "__main__":
    main()
