"""How much of a BF16 model changes per optimizer step at RL learning rates (issue 24).

    python benchmarks/bench_delta_fraction.py --steps 25 --out delta_fraction.json

The model is a small GPT-style transformer LM (token + position embeddings, pre-norm blocks of
causal self-attention and an MLP, tied-free output head) trained with **Megatron's mixed
precision**: the parameters the forward pass uses (and a publisher would publish) are BF16; the
optimizer keeps FP32 master weights and runs Adam (betas 0.9/0.95, eps 1e-8, weight decay 0.01,
Megatron's defaults for GPT) on them with the BF16 gradients cast to FP32; after each step the
master weights are rounded to nearest into the BF16 parameters, as Megatron's
``_copy_main_params_to_model_params`` does.

The loss is a real next-token cross-entropy over a fixed byte-level token stream: the Python
standard library's own source text (read from ``sysconfig``'s stdlib directory), so every run
on every machine sees the same bytes. The model is first trained ``--warmup`` steps at 1e-3 (a
"pretrained" starting point); then, from that same state, each RL learning rate runs
``--steps`` steps with a fresh Adam (as an RL job starting from a checkpoint does), and after
every step the published BF16 tensors are compared bit for bit with the previous step's.

Reported per learning rate and step:
- ``changed_fraction``: changed BF16 elements / all elements (= changed bytes at element
  granularity, every element is 2 bytes);
- ``block_fraction[B]``: the fraction of B-byte blocks holding at least one changed element
  (what a block-granular delta would move);
- ``record_fraction``: bytes of mx-refit's delta records (:func:`mx_refit.delta.records.encode`:
  per tensor the smallest of SPARSE chunk-offset lists, 256-byte BLOCKS, or WHOLE) over the
  model's bytes: what a delta refit puts on the wire;
- ``naive_fraction``: the same with int32 indices + BF16 values per changed element (for
  comparison).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import sysconfig
import time
from pathlib import Path

BLOCKS = (64, 256, 4096, 65536)
RECORD_BLOCK = 256


def token_stream(limit: int):
    import torch

    root = Path(sysconfig.get_paths()["stdlib"])
    data = bytearray()
    for path in sorted(root.glob("*.py")):
        data += path.read_bytes()
        if len(data) >= limit:
            break
    return torch.frombuffer(bytes(data[:limit]), dtype=torch.uint8).long()


def build_model(vocab: int, dim: int, layers: int, heads: int, seq: int):
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1 = nn.LayerNorm(dim)
            self.qkv = nn.Linear(dim, 3 * dim)
            self.proj = nn.Linear(dim, dim)
            self.ln2 = nn.LayerNorm(dim)
            self.fc1 = nn.Linear(dim, 4 * dim)
            self.fc2 = nn.Linear(4 * dim, dim)

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, heads, d // heads).unbind(2)
            att = nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
            )
            x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
            return x + self.fc2(nn.functional.gelu(self.fc1(self.ln2(x))))

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(vocab, dim)
            self.pos = nn.Embedding(seq, dim)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln = nn.LayerNorm(dim)
            self.head = nn.Linear(dim, vocab, bias=False)

        def forward(self, idx):
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln(x))

    torch.manual_seed(0)
    model = LM()
    for p in model.parameters():
        if p.dim() >= 2:
            nn.init.normal_(p, std=0.02)
    return model


class MixedPrecision:
    """BF16 model params, FP32 master weights, Adam on the masters (Megatron's scheme)."""

    def __init__(self, model, lr: float, masters=None) -> None:
        import torch

        self.model = model.to(torch.bfloat16)
        self.params = list(self.model.parameters())
        if masters is None:
            masters = [p.detach().float().clone() for p in self.params]
        self.masters = [m.clone().requires_grad_(True) for m in masters]
        self.opt = torch.optim.AdamW(
            self.masters, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01
        )

    def step(self, batch) -> float:
        import torch

        for p in self.params:
            p.grad = None
        logits = self.model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)
        )
        loss.backward()
        for p, m in zip(self.params, self.masters):
            m.grad = p.grad.float()
        self.opt.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                p.copy_(m)  # round to nearest, as Megatron copies main params to model params
        return float(loss.detach())


def batches(stream, batch: int, seq: int, seed: int):
    import torch

    gen = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(stream) - seq - 1, (batch,), generator=gen)
        yield torch.stack([stream[s : s + seq + 1] for s in starts.tolist()])


def record_bytes(changed, numel: int) -> int:
    """Bytes of the smaller compact record of one tensor's change (dense: the tensor whole)."""
    n = int(changed.sum())
    if n == 0:
        return 0
    sparse = n * (4 + 2)
    per_block = RECORD_BLOCK // 2
    padded = math.ceil(numel / per_block) * per_block
    flags = changed.new_zeros(padded)
    flags[:numel] = changed
    blocks = int(flags.view(-1, per_block).any(1).sum())
    blocked = math.ceil(padded / per_block / 8) + blocks * RECORD_BLOCK
    return min(sparse, blocked, numel * 2)


def compare(prev, cur) -> dict:
    import torch

    from mx_refit.delta.records import encode
    from mx_refit.types import DeltaForm

    total = changed_total = record = naive = 0
    block_hits = {b: 0 for b in BLOCKS}
    block_total = {b: 0 for b in BLOCKS}
    for a, b in zip(prev, cur):
        changed = a.reshape(-1).view(torch.int16) != b.reshape(-1).view(torch.int16)
        numel = changed.numel()
        total += numel
        changed_total += int(changed.sum())
        naive += record_bytes(changed, numel)
        rec = encode(a, b)
        if rec is not None:
            record += numel * 2 if rec.form is DeltaForm.WHOLE else rec.data.numel()
        for size in BLOCKS:
            per = size // 2
            padded = math.ceil(numel / per) * per
            flags = changed.new_zeros(padded)
            flags[:numel] = changed
            block_hits[size] += int(flags.view(-1, per).any(1).sum())
            block_total[size] += padded // per
    return {
        "changed_fraction": changed_total / total,
        "block_fraction": {str(s): block_hits[s] / block_total[s] for s in BLOCKS},
        "record_fraction": record / (2 * total),
        "naive_fraction": naive / (2 * total),
    }


def run(args) -> dict:
    import torch

    torch.set_num_threads(max(1, args.threads))
    stream = token_stream(args.tokens)
    model = build_model(256, args.dim, args.layers, args.heads, args.seq)
    data = batches(stream, args.batch, args.seq, seed=1)
    warm = MixedPrecision(model, 1e-3)
    warm_losses = [warm.step(next(data)) for _ in range(args.warmup)]
    start_masters = [m.detach().clone() for m in warm.masters]
    start_params = [p.detach().clone() for p in warm.params]
    numel = sum(p.numel() for p in start_params)
    out = {"params": numel, "bf16_bytes": 2 * numel, "warmup_loss": warm_losses[-1:], "runs": {}}
    for lr in args.lrs:
        with torch.no_grad():
            for p, s in zip(warm.params, start_params):
                p.copy_(s)
        mp = MixedPrecision(warm.model, lr, masters=start_masters)
        data = batches(stream, args.batch, args.seq, seed=2)  # every lr sees the same batches
        prev = [p.detach().clone() for p in mp.params]
        steps = []
        for step in range(args.steps):
            loss = mp.step(next(data))
            cur = [p.detach().clone() for p in mp.params]
            row = {"step": step + 1, "loss": loss, **compare(prev, cur)}
            steps.append(row)
            prev = cur
            print(f"lr={lr:g} step={step + 1} loss={loss:.4f} "
                  f"changed={row['changed_fraction']:.4%} record={row['record_fraction']:.4%} "
                  f"blocks4k={row['block_fraction']['4096']:.2%}", flush=True)
        tail = steps[len(steps) // 2 :]
        out["runs"][f"{lr:g}"] = {
            "steps": steps,
            "steady_changed_mean": sum(r["changed_fraction"] for r in tail) / len(tail),
            "steady_record_mean": sum(r["record_fraction"] for r in tail) / len(tail),
            "steady_naive_mean": sum(r["naive_fraction"] for r in tail) / len(tail),
        }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 1e-5, 1e-4])
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=4 << 20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    started = time.perf_counter()
    result = run(args)
    import torch

    result["config"] = vars(args)
    result["machine"] = {"python": sys.version.split()[0], "torch": torch.__version__,
                         "platform": platform.platform()}
    result["seconds"] = time.perf_counter() - started
    for lr, r in result["runs"].items():
        print(f"lr={lr}: steady changed {r['steady_changed_mean']:.4%}, "
              f"record {r['steady_record_mean']:.4%} of {result['bf16_bytes']} bytes")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
