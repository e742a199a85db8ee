"""The attention kernels of phasewise's CPU paths side by side, on this machine.

Decode (one new token a request against its keys in the paged cache), for each case of
requests x keys x query heads / KV heads x head size, it times what runs here of:

* ``keys-lanes``: the AVX512_BF16 kernel with 16 keys in the vector lanes (``attend_group_kl``;
  the engine's choice for up to 8 query heads a KV head where the CPU has AVX512_BF16 and no
  AMX);
* ``heads-lanes``: the same kernel with the query heads in the lanes
  (``pw_avx512bf16_attn_kl = 0``, a switch of the benchmark build: ``kernels.use_bench_build``;
  the engine's choice for 9-16 heads a KV head);
* ``amx``: the AMX tile kernel (where the CPU has AMX: the engine's choice there);
* ``avx2``: the 8-lane fp32 kernel of CPUs without either;
* ``torch``: phasewise's torch path (the context's blocks gathered, then torch's attention in
  bf16), the yardstick.

Prefill (a prompt's causal attention, its K/V already in the paged cache), for each prompt
length and head shape:

* ``kernel``: phasewise's kernel here (``pw_prefill_attention_amx`` with AMX, else
  ``pw_prefill_attention_avx512bf16``);
* ``torch-sdpa``: ``F.scaled_dot_product_attention`` (causal, bf16) on contiguous K/V, no
  gather: torch's best case.

The methods run interleaved, round after round, each call repeated for ~20 ms a round with
the same keys (so keys come from the caches where they fit: the kernels' arithmetic, not the
memory's), and the median round counts. It prints microseconds a call, each method's ratio
to torch's (higher is faster), and the largest difference from torch's outputs.

    .venv/bin/python -m benchmarks.bench_attention [--rounds 5] [--quick]
"""

from __future__ import annotations

import argparse
import ctypes
import sys

import torch
import torch.nn.functional as F

from benchmarks.harness import (interleaved_medians, machine_info,  # noqa: E402
                                machine_line, timed)

from phasewise.model.cpu import kernels as cpu_kernels  # noqa: E402
from phasewise.model.attention import AttentionMetadata, PrefillSpan  # noqa: E402
from phasewise.model.cpu.linear import LinearDispatch  # noqa: E402
from phasewise.model.cpu.ops import CpuKernelOps
from phasewise.model.ops import TorchOps  # noqa: E402

BS = 16  # the engine's block size
# requests, keys a request, query heads, KV heads, head size
DECODE = [(1, 200, 14, 2, 64), (8, 200, 14, 2, 64), (32, 200, 14, 2, 64),
          (1, 4000, 14, 2, 64),  # Qwen2-0.5B's shape (the reference checkpoint)
          (8, 1000, 32, 8, 128),  # Llama-3-8B's
          (8, 500, 16, 16, 64),  # no grouping
          (8, 500, 32, 2, 64)]  # 16 query heads a KV head
# prompt tokens, query heads, KV heads, head size
PREFILL = [(128, 14, 2, 64), (512, 14, 2, 64), (2048, 14, 2, 64), (512, 32, 8, 128)]
QUICK_DECODE, QUICK_PREFILL = DECODE[1:2] + DECODE[4:5], PREFILL[1:2]


def paged(context: list[int], n_kv: int, hd: int, seed: int):
    """Block tables (each context's blocks in a shuffled order in a shared pool) and random
    bf16 K/V caches holding them."""
    g = torch.Generator().manual_seed(seed)
    n_blocks = [c // BS + 1 for c in context]
    order = torch.randperm(sum(n_blocks), generator=g).tolist()
    tables, at = [], 0
    for n in n_blocks:
        tables.append(order[at:at + n])
        at += n
    k = torch.randn(sum(n_blocks), BS, n_kv, hd, generator=g).bfloat16()
    v = torch.randn(sum(n_blocks), BS, n_kv, hd, generator=g).bfloat16()
    return tables, k, v, g


class Switch:
    """A kernel choice in the library's globals, set for one method's calls and put back."""

    def __init__(self, lib: ctypes.CDLL, settings: dict[str, int]) -> None:
        self.lib, self.settings = lib, settings

    def __enter__(self) -> None:
        for name, value in self.settings.items():
            if name == "avx512bf16_attention":
                self.lib.pw_enable_avx512bf16_attention(value)
            elif name == "avx512":
                self.lib.pw_enable_avx512(value)
            else:
                ctypes.c_int.in_dll(self.lib, name).value = value

    def __exit__(self, *exc) -> None:
        amx, bf16dp = cpu_kernels.amx_available(), cpu_kernels.avx512bf16_available()
        if amx:
            self.lib.pw_enable_avx512(1)
        if bf16dp:
            self.lib.pw_enable_avx512bf16_attention(0 if amx else 1)
            ctypes.c_int.in_dll(self.lib, "pw_avx512bf16_attn_kl").value = 1


def decode_methods(lib: ctypes.CDLL) -> dict[str, dict[str, int] | None]:
    """Method name -> the library settings that select it (None: torch)."""
    out: dict[str, dict[str, int] | None] = {}
    if cpu_kernels.amx_available():
        out["amx"] = {}
        out["avx2"] = {"avx512": 0}
    elif cpu_kernels.avx512bf16_available():
        out["keys-lanes"] = {"pw_avx512bf16_attn_kl": 1}
        out["heads-lanes"] = {"pw_avx512bf16_attn_kl": 0}
        out["avx2"] = {"avx512bf16_attention": 0}
    else:
        out["avx2"] = {}
    out["torch"] = None
    return out


def rounds_of(calls: dict, rounds: int) -> dict[str, float]:
    """Median seconds a call of each method, the methods interleaved round after round (the
    order reversed every other round: ``harness.interleaved_medians``)."""
    return interleaved_medians(calls, rounds)


def bench_decode(lib: ctypes.CDLL, cases: list, rounds: int) -> None:
    ops, ref_ops = CpuKernelOps(LinearDispatch(kernel_max_rows=8, large="torch")), TorchOps()
    methods = decode_methods(lib)
    print("decode attention (us a call; x: torch's time over the method's)")
    print(f"{'requests':>8}{'keys':>6}{'heads':>8}{'hd':>5}"
          + "".join(f"{m:>20}" for m in methods) + "   max |diff| vs torch")
    for b, ctx, nh, nkv, hd in cases:
        tables, k, v, g = paged([ctx] * b, nkv, hd, seed=ctx + b)
        meta = AttentionMetadata.build(chunk_lens=[1] * b, context_lens=[ctx] * b,
                                       block_tables=tables, block_size=BS,
                                       device=torch.device("cpu"))
        q = torch.randn(b, nh, hd, generator=g).bfloat16()
        scale = hd ** -0.5
        outs, calls = {}, {}
        for name, settings in methods.items():
            if settings is None:
                def call(): return ref_ops.decode_attention(q, k, v, meta, scale)
            else:
                def call(settings=settings):
                    with Switch(lib, settings):
                        return ops.decode_attention(q, k, v, meta, scale)
            outs[name] = call()
            calls[name] = lambda call=call: timed(call)
        times = rounds_of(calls, rounds)
        base = times["torch"]
        diff = max((outs[n].float() - outs["torch"].float()).abs().max().item() for n in outs)
        print(f"{b:>8}{ctx:>6}{f'{nh}/{nkv}':>8}{hd:>5}"
              + "".join(f"{times[n] * 1e6:>11.1f} x{base / times[n]:<7.2f}" for n in methods)
              + f"   {diff:.3g}")


def bench_prefill(lib: ctypes.CDLL, cases: list, rounds: int) -> None:
    if not (cpu_kernels.amx_available() or cpu_kernels.avx512bf16_available()):
        print("prefill attention: no AMX or AVX512_BF16 kernel on this CPU (torch's SDPA runs)")
        return
    ops = CpuKernelOps(LinearDispatch(kernel_max_rows=8, large="torch"))
    print("prefill attention, causal (us a call; x: torch's time over the kernel's; GFLOP/s of "
          "the causal products)")
    print(f"{'tokens':>8}{'heads':>8}{'hd':>5}{'kernel us':>12}{'x':>7}{'GFLOP/s':>9}"
          f"{'torch-sdpa us':>15}   max |diff| vs torch")
    for n, nh, nkv, hd in cases:
        tables, k, v, g = paged([n], nkv, hd, seed=n)
        table = torch.tensor(tables[0], dtype=torch.int64)
        slots = torch.tensor([tables[0][i // BS] * BS + i % BS for i in range(n)])
        q = torch.randn(n, nh, hd, generator=g).bfloat16()
        kc = k.view(-1, nkv, hd)[slots].transpose(0, 1)  # [nkv, n, hd], contiguous below
        vc = v.view(-1, nkv, hd)[slots].transpose(0, 1)
        kq = kc.repeat_interleave(nh // nkv, dim=0).contiguous()  # [nh, n, hd]
        vq = vc.repeat_interleave(nh // nkv, dim=0).contiguous()
        qt = q.transpose(0, 1).contiguous()
        span = PrefillSpan(start=0, end=n, context_len=0, block_table=table, mask=None)
        out = torch.empty(n, nh, hd, dtype=torch.bfloat16)
        scale = hd ** -0.5

        def kernel():
            assert ops.prefill_attention(q, k, v, span, scale, out)
            return out

        def sdpa():
            return F.scaled_dot_product_attention(qt, kq, vq, is_causal=True, scale=scale)

        diff = (kernel().float() - sdpa().transpose(0, 1).float()).abs().max().item()
        times = rounds_of({"kernel": lambda: timed(kernel), "sdpa": lambda: timed(sdpa)},
                          rounds)
        flops = 4 * nh * hd * n * (n + 1) / 2
        print(f"{n:>8}{f'{nh}/{nkv}':>8}{hd:>5}{times['kernel'] * 1e6:>12.0f}"
              f"{times['sdpa'] / times['kernel']:>7.2f}{flops / times['kernel'] / 1e9:>9.0f}"
              f"{times['sdpa'] * 1e6:>15.0f}   {diff:.3g}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (median counts)")
    p.add_argument("--quick", action="store_true", help="one or two cases of each")
    a = p.parse_args()
    if a.rounds < 1:
        p.error(f"--rounds must be at least 1; got {a.rounds}")
    cpu_kernels.use_bench_build()  # the variants' switches (pw_avx512bf16_attn_kl) as globals
    lib = cpu_kernels.load()
    if lib is None:
        sys.exit(f"phasewise's CPU kernels are unavailable here: {cpu_kernels.KERNELS.reason}")
    print(machine_line(machine_info()))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    bench_decode(lib, QUICK_DECODE if a.quick else DECODE, a.rounds)
    print()
    bench_prefill(lib, QUICK_PREFILL if a.quick else PREFILL, a.rounds)


if __name__ == "__main__":
    main()
