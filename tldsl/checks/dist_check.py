"""Correctness and stress checks of the fused distributed ops on GPUs (run under torchrun).

    torchrun --standalone --nproc_per_node=2 -m tldsl.checks.dist_check [ag_gemm|gemm_rs|all]
        [--variants NAME,...] [--checks odd_m,straggler,back_to_back,streams] [--iters 5]
        [--launches 1000] [--stream-launches 24] [--timeout 300] [--debug-timeout-ns N] [--seed 0]
    python -m tldsl.checks.dist_check explain LOGFILE     # decode stuck-wait lines of a log

Checks (each on a freshly built op, for every variant of the op: its engines / schedules):

* ``odd_m`` — M = 4091 * W (odd, not a multiple of any tile; 4096 * W for a schedule that needs
  whole GEMM tiles per rank, K and N still odd multiples of 8), ``--iters`` iterations with fresh
  random inputs; before each, every data workspace of the op (symmetric staging buffers,
  partials) is filled with random values and the outputs with NaN, so stale or missing tiles
  show; compared with NCCL + ``torch.matmul`` (fp32) at ``|err| <= 1e-2 |ref| + 1e-2 rms(ref)``.
* ``straggler`` — iterations where one random rank sleeps on the host before enqueueing its
  communication, another runs ``torch.cuda._sleep`` on its compute stream before the GEMM, and
  (SM engines only) a third delays its communication stream on the device. Each result checked.
  (A device sleep on a copy-engine communication stream would need an SM while the persistent
  GEMM holds them all and waits for that stream: a deadlock by construction, so it is not
  injected there. Everything that runs beside a spinning kernel — ``_sleep``, the barrier
  kernel — is loaded before the first launch: CUDA's lazy loading would otherwise wait for the
  spinning kernel.)
* ``back_to_back`` — ``--launches`` launches without synchronising (after the second), then the
  outputs of launches 1, 1/4, 1/2, 3/4 and the last are checked, and every signal counter must
  have moved by the same step every launch: its value after launch 1 plus (launches - 1) times
  its step from launch 1 to 2 (epochs never reset, never skip; a counter may lag one launch, like
  the copy-engine push's "this rank is done with the landing slot", written at the next launch).

* ``streams`` — ``--stream-launches`` launches without synchronising, alternating between the
  current stream and a second one, some of them behind a device sleep on their stream (so the
  other stream's next launch could run ahead); every launch's output checked. The ops promise
  that launches run in call order whatever stream each call is made on
  (``runtime/dist/call_order.py``): their counters and reused buffers depend on it.

Every check prints one summary line (rank 0) and the process exits non-zero on any failure.

Debugging a hang: ``--debug-timeout-ns N`` (or ``TLDSL_WAIT_TIMEOUT_NS``) compiles every wait
with a timeout that prints ``tldsl: wait timed out: slot 0x... holds V, needs T (block, thread)``
and traps, and gives the group barriers a timeout; each rank prints its signal map
(``[rank r] signal NAME @ 0x... x SLOTS (note)``) when an op is built, and ``explain`` decodes
the stuck slot from a saved log. Without it, a watchdog (``--timeout`` seconds per check) reports
the stuck check, its launch, and every counter below its expected value (read through a copy on
a separate stream, which needs no SM), then exits with 124.
"""
from __future__ import annotations

import argparse
import gc
import os
import random
import re
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

CHECKS = ("odd_m", "straggler", "back_to_back", "streams")
RTOL, ATOL_RMS = 1e-2, 1e-2


# =================================================================================================
# pure helpers (host-tested)
# =================================================================================================

_MAP_RE = re.compile(r"\[rank (\d+)\] signal (\S+) @ (0x[0-9a-fA-F]+) x (\d+)(?: \((.*)\))?")
_TIMEOUT_RE = re.compile(r"tldsl: wait timed out: slot (0x[0-9a-fA-F]+|\(nil\)) holds (\d+), needs (\d+) "
                         r"\(block (\d+), thread (\d+)\)")
_BARRIER_RE = re.compile(r"CUDASymmetricMemory::(barrier|put_signal|wait_signal)")


def map_line(rank: int, name: str, addr: int, slots: int, note: str = "") -> str:
    """The line a rank prints for one of its signal arrays (what :func:`explain_log` parses)."""
    return f"[rank {rank}] signal {name} @ {addr:#x} x {slots}" + (f" ({note})" if note else "")


def summarize_log(text: str) -> tuple[list[str], bool]:
    """A dist_check log's result lines (``dist_check <op>/<variant> <check>: PASS|FAIL ...``, and
    the closing ``dist_check: ...``), and whether it closed with every check passed. torchrun may
    prefix lines (``[rank0]:``), so lines are matched anywhere."""
    lines = [line.strip() for line in text.splitlines() if "dist_check " in line or "dist_check:" in line]
    results = [line for line in lines if ": PASS" in line or ": FAIL" in line]
    passed = bool(results) and all(": PASS" in line for line in results) and \
        any(line.endswith("dist_check: all passed") for line in lines)
    return lines, passed


def explain_log(text: str) -> list[str]:
    """Decode every stuck-wait line of a log with the signal maps printed in the same log."""
    maps = []
    for m in _MAP_RE.finditer(text):
        maps.append((int(m.group(1)), m.group(2), int(m.group(3), 16), int(m.group(4)), m.group(5) or ""))
    out = []
    for m in _TIMEOUT_RE.finditer(text):
        addr_s, held, need, block, thread = m.groups()
        held, need = int(held), int(need)
        addr = 0 if addr_s == "(nil)" else int(addr_s, 16)
        hits = [(r, n, (addr - base) // 8, note) for r, n, base, slots, note in maps
                if base <= addr < base + 8 * slots and (addr - base) % 8 == 0]
        head = f"stuck wait at {addr_s} (block {block}, thread {thread}) holds {held}, needs {need}"
        if not hits:
            out.append(f"{head}: not in any printed signal map (run with --debug-timeout-ns so ranks print them)")
            continue
        for r, n, slot, note in hits:
            out.append(f"{head}: {n}[{slot}] of rank {r}" + (f" ({note})" if note else "")
                       + f" — {need - held} notify(s) missing")
        if len(hits) > 1:
            out.append("  (several ranks map that address: the rank that printed the line is the one whose kernel "
                       "waits; torchrun --tee 3 or per-rank logs tell them apart)")
    if _BARRIER_RE.search(text):
        out.append("a torch symmetric-memory barrier / signal timed out: some rank never reached it (stuck in an "
                   "earlier launch, or crashed)")
    return out


def compare(got, ref, rtol: float = RTOL, atol_rms: float = ATOL_RMS, row_block: int = 128, slack=None) -> dict:
    """Elementwise ``|got - ref| <= rtol |ref| + atol_rms * rms(ref) + slack`` (torch tensors, any
    device; ``slack`` an optional elementwise bound of rounding the op does and ``ref`` does not).
    Returns ok, max error, the worst element's tolerance, NaN / bad counts and the bad row blocks."""
    import torch
    g, r = got.float(), ref.float()
    if tuple(g.shape) != tuple(r.shape):
        return dict(ok=False, max_err=float("inf"), detail=f"shape {tuple(g.shape)} != {tuple(r.shape)}")
    rms = float(r.pow(2).mean().sqrt().item()) if r.numel() else 0.0
    err = (g - r).abs()
    tol = rtol * r.abs() + atol_rms * max(rms, 1e-6)
    if slack is not None:
        tol = tol + slack
    nan = torch.isnan(g)
    bad = (err > tol) | nan
    n_bad, n_nan = int(bad.sum().item()), int(nan.sum().item())
    finite = torch.where(nan, torch.zeros_like(err), err)
    out = dict(ok=n_bad == 0, max_err=float(finite.max().item()) if err.numel() else 0.0, rms=rms,
               n_bad=n_bad, n_nan=n_nan, detail="")
    if n_bad:
        idx = bad.nonzero()
        rows = sorted({int(i) // row_block for i in idx[:, 0].tolist()})
        first = tuple(int(x) for x in idx[0].tolist())
        shown = ", ".join(f"[{b * row_block}, {(b + 1) * row_block})" for b in rows[:8]) + (" ..." if len(rows) > 8 else "")
        out["detail"] = (f"{n_bad} element(s) out of tolerance ({n_nan} NaN: never written), first at {first} "
                         f"got {float(g[first].item()):.4g} want {float(r[first].item()):.4g}; row blocks {shown}")
    return out


def rs_reference(a, b, world_size: int, partial_dtype: str = "out"):
    """``(slack, ref)`` of GEMM+ReduceScatter on this rank (under torch.distributed): ``ref`` the
    fp32 reduce-scatter of the products — each rounded to A's dtype first when the op keeps its
    partials in that dtype (``partial_dtype="out"``, NCCL + cuBLAS's numerics) — and ``slack``
    (None for fp32 partials) ``2^-7 * sum_r |P_r|`` (bf16; ``2^-10`` for fp16): one ulp of every
    rounded partial, the most a different fp32 accumulation order can change it by."""
    import torch
    import torch.distributed as dist
    full = torch.matmul(a.float(), b.float())
    ref = torch.empty(a.shape[0] // world_size, b.shape[1], device=a.device, dtype=torch.float32)
    if partial_dtype == "f32":
        dist.reduce_scatter_tensor(ref, full)
        return None, ref
    slack = torch.empty_like(ref)
    dist.reduce_scatter_tensor(slack, full.abs())
    dist.reduce_scatter_tensor(ref, full.to(a.dtype).float())
    return slack.mul_(2.0 ** (-10 if a.dtype == torch.float16 else -7)), ref


def missing_notifies(counters: dict, per_launch: dict | None, launch: int, limit: int = 24) -> list[str]:
    """Slots below ``per_launch * launch`` (what a stuck launch has not received yet)."""
    out = []
    for name, vals in counters.items():
        base = (per_launch or {}).get(name)
        for i, v in enumerate(vals):
            if base is None:
                continue
            want = base[i] * launch
            if v < want:
                out.append(f"{name}[{i}] = {v} < {want} ({base[i]} per launch)")
    if len(out) > limit:
        out = out[:limit] + [f"... {len(out) - limit} more"]
    return out


# =================================================================================================
# variants and problem sizes
# =================================================================================================

@dataclass(frozen=True)
class Variant:
    op: str                  # ag_gemm | gemm_rs
    name: str
    kwargs: tuple = ()       # constructor keyword arguments (name, value) pairs
    sm_comm: bool = False    # the communication runs on reserved SMs (device delays are safe there)
    rows: int | None = None  # rows per rank of the odd-size checks, where the schedule needs whole tiles
    dtype: str = "bfloat16"  # the inputs' and outputs' torch dtype (bfloat16 or float16)

    @property
    def label(self) -> str:
        return f"{self.op}/{self.name}"


def variants(op: str) -> list[Variant]:
    from tldsl.ir.schedule import CommSchedule
    if op == "ag_gemm":
        return [Variant("ag_gemm", "copy_engine"),
                Variant("ag_gemm", "copy_engine-kernel", (("handshake", "kernel"),)),
                Variant("ag_gemm", "copy_engine-memops", (("handshake", "memops"),)),
                Variant("ag_gemm", "copy_engine-comm_first", (("enqueue", "comm_first"),)),
                # the GEMM stages this rank's rows itself (whole tiles per rank)
                Variant("ag_gemm", "copy_engine-gemm_staging", (("staging", "gemm"),), rows=4096),
                Variant("ag_gemm", "copy_engine-plan", (("ce_executor", "plan"),)),
                # copy-engine push: the plan at any M; direct (the GEMM gathers, whole tiles per rank)
                Variant("ag_gemm", "copy_engine-push", (("comm", CommSchedule(engine="copy_engine", mode="push")),
                                                        ("ce_executor", "plan"))),
                Variant("ag_gemm", "copy_engine-push-direct",
                        (("comm", CommSchedule(engine="copy_engine", mode="push")), ("ce_executor", "direct")),
                        rows=4096),
                # the push in column slices, each waited for as the GEMM's K loop reaches it: direct
                # (whole tiles per rank) and the plan (any M); 1032 / 1024 columns: 5 / 4 slices
                Variant("ag_gemm", "copy_engine-push-sliced",
                        (("comm", CommSchedule(engine="copy_engine", mode="push", col_tile=256)),
                         ("ce_executor", "direct")), rows=4096),
                Variant("ag_gemm", "copy_engine-push-sliced-plan",
                        (("comm", CommSchedule(engine="copy_engine", mode="push", col_tile=256)),
                         ("ce_executor", "plan"))),
                # fp16: the defaults at odd M (the pull) and at whole tiles per rank (the sliced push)
                Variant("ag_gemm", "copy_engine-f16", dtype="float16"),
                Variant("ag_gemm", "copy_engine-push-sliced-f16", rows=4096, dtype="float16"),
                # the GEMM pushes this rank's rows itself (no copy engine; whole tiles per rank)
                Variant("ag_gemm", "gemm-push",
                        (("comm", CommSchedule(engine="copy_engine", mode="push")), ("ce_executor", "direct"),
                         ("pusher", "gemm")), rows=4096),
                Variant("ag_gemm", "sm-pull", (("engine", "sm"),), True),
                Variant("ag_gemm", "sm-push",
                        (("comm", CommSchedule(engine="sm", mode="push", order="ring", tile_m=128, sms=8)),), True),
                Variant("ag_gemm", "sm-push-nvshmem",
                        (("comm", CommSchedule(engine="sm", mode="push", order="ring", tile_m=128, sms=8,
                                               transport="nvshmem")),), True),
                Variant("ag_gemm", "sm-push-f16",
                        (("comm", CommSchedule(engine="sm", mode="push", order="ring", tile_m=128, sms=8)),), True,
                        dtype="float16")]
    if op == "gemm_rs":
        epilogue = CommSchedule(engine="copy_engine", mode="push", reduce_in="epilogue")
        return [Variant("gemm_rs", "copy_engine"),
                Variant("gemm_rs", "copy_engine-f16", dtype="float16"),
                Variant("gemm_rs", "copy_engine-f32", (("partial_dtype", "f32"),)),
                # this rank's rows summed in the GEMM epilogue (M/W must be whole tiles:
                # here at every check, K and N still odd multiples of 8)
                Variant("gemm_rs", "copy_engine-epilogue", (("comm", epilogue),), rows=4096),
                Variant("gemm_rs", "copy_engine-epilogue-f32", (("comm", epilogue), ("partial_dtype", "f32")),
                        rows=4096),
                Variant("gemm_rs", "sm-push", (("engine", "sm"),), True),
                Variant("gemm_rs", "sm-push-f32", (("engine", "sm"), ("partial_dtype", "f32")), True),
                # fp16 sums in the communication kernel and in the GEMM's epilogue
                Variant("gemm_rs", "sm-push-f16", (("engine", "sm"),), True, dtype="float16"),
                Variant("gemm_rs", "copy_engine-epilogue-f16", (("comm", epilogue),), rows=4096, dtype="float16"),
                Variant("gemm_rs", "sm-push-nvshmem",
                        (("comm", CommSchedule(engine="sm", mode="push", order="ring", tile_m=64, sms=16,
                                               transport="nvshmem")),), True),
                Variant("gemm_rs", "sm-pull",
                        (("comm", CommSchedule(engine="sm", mode="pull", order="ring", tile_m=128, sms=16)),), True),
                Variant("gemm_rs", "sm-push-full_mesh",
                        (("comm", CommSchedule(engine="sm", mode="push", order="full_mesh", tile_m=128, sms=16)),),
                        True)]
    raise SystemExit(f"unknown op {op!r}: ag_gemm, gemm_rs or all")


def sizes(check: str, W: int, v: Variant | None = None) -> tuple[int, int, int]:
    """(rows per rank, K, N) — AG: A shard [rows, K], B [K, N]; RS: A [W*rows, K], B [K, N]."""
    if check in ("back_to_back", "streams"):
        return 1024, 1024, 1024
    if v is not None and v.rows is not None:
        return v.rows, 1032, 3000    # the variant's rows; K, N not multiples of the tile
    return 4091, 1032, 3000          # odd rows; K, N not multiples of the tile either


# =================================================================================================
# the GPU side
# =================================================================================================

class CounterReader:
    """Reads an op's signal counters through a D2H copy on its own stream into pinned memory
    allocated up front: usable while kernels spin (the copy engine does it, no SM needed)."""

    def __init__(self, op):
        import torch
        self.tensors = op.signal_tensors()
        self.stream = torch.cuda.Stream()
        self.host = {nm: torch.empty(t.numel(), dtype=torch.int64, pin_memory=True) for nm, t in self.tensors.items()}
        self.event = torch.cuda.Event()

    def read(self, timeout_s: float = 5.0) -> dict | None:
        import torch
        with torch.cuda.stream(self.stream):
            for nm, t in self.tensors.items():
                self.host[nm].copy_(t, non_blocking=True)
            self.event.record(self.stream)
        deadline = time.time() + timeout_s
        while not self.event.query():
            if time.time() > deadline:
                return None
            time.sleep(0.02)
        return {nm: h.tolist() for nm, h in self.host.items()}


@dataclass
class CheckState:
    label: str
    op: object = None
    reader: CounterReader | None = None
    per_launch: dict | None = None
    completed: int = 0
    notes: list = field(default_factory=list)


class Env:
    def __init__(self, args):
        import torch
        import torch.distributed as dist
        self.args = args
        self.torch, self.dist = torch, dist
        self.rank, self.W = dist.get_rank(), dist.get_world_size()
        self.gloo = dist.new_group(backend="gloo")     # host-side agreement, works even if CUDA is wedged
        from tldsl import env
        self.debug = bool(env.get("TLDSL_WAIT_TIMEOUT_NS"))
        self.state: CheckState | None = None

    def say(self, msg: str, all_ranks: bool = False):
        if all_ranks or self.rank == 0:
            print(msg if all_ranks is False else f"[rank {self.rank}] {msg}", flush=True)

    def agree(self, ok: bool, value: float = 0.0) -> tuple[bool, float]:
        t = self.torch.tensor([0.0 if ok else 1.0, float(value)])
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX, group=self.gloo)
        return t[0].item() == 0.0, float(t[1].item())

    def barrier(self):
        self.torch.cuda.synchronize()
        self.dist.barrier(group=self.gloo)

    def sync(self):
        self.torch.cuda.synchronize()

    def generator(self, seed: int):
        return self.torch.Generator(device="cuda").manual_seed(seed)

    def sizes(self, check: str, v: Variant | None = None) -> tuple[int, int, int]:
        return sizes(check, self.W, v)

    def device_sleep(self, stream, cycles: int):
        with self.torch.cuda.stream(stream):
            self.torch.cuda._sleep(cycles)

    def current_stream(self):
        return self.torch.cuda.current_stream()

    def new_stream(self):
        return self.torch.cuda.Stream()

    def on_stream(self, stream):
        """Work after this on ``stream`` (a context), which first waits for the current stream."""
        stream.wait_stream(self.torch.cuda.current_stream())
        return self.torch.cuda.stream(stream)

    def build(self, v: Variant, rows: int, k: int, n: int):
        from tldsl.runtime.dist import AllGatherMatmul, MatmulReduceScatter
        kw = dict(v.kwargs)
        if v.op == "ag_gemm":
            op = AllGatherMatmul(rows, k, n, getattr(self.torch, v.dtype), **kw)
        else:
            op = MatmulReduceScatter(self.W * rows, k, n, getattr(self.torch, v.dtype), **kw)
        st = self.state
        st.op = op
        st.reader = CounterReader(op)
        st.per_launch = None
        st.completed = 0
        if self.debug:
            for nm, addr, slots, note in op.signal_map():
                print(map_line(self.rank, nm, addr, slots, note), flush=True)
        return op

    def inputs(self, v: Variant, rows, k, n, seed):
        torch = self.torch
        g = self.generator(seed)
        m = rows if v.op == "ag_gemm" else self.W * rows
        dt = getattr(torch, v.dtype)
        a = torch.randn(m, k, device="cuda", dtype=dt, generator=g)
        b = torch.randn(k, n, device="cuda", dtype=dt, generator=g)
        return a, b

    def reference(self, v: Variant, a, b):
        """AG: (NCCL-gathered A, fp32 gathered @ B); RS: (slack, NCCL fp32 reduce-scatter of A @ B).

        RS with partials in A's dtype (the default ``partial_dtype="out"``): every rank's product
        is rounded to bf16 before the sum, as NCCL + cuBLAS do; the reference is the fp32 sum of
        those rounded products, and the slack ``2^-7 * sum_r |P_r|`` bounds the one-ulp
        difference that a different fp32 accumulation order can make to each rounded partial."""
        torch, dist = self.torch, self.dist
        if v.op == "ag_gemm":
            gathered = torch.empty(self.W * a.shape[0], a.shape[1], device="cuda", dtype=a.dtype)
            dist.all_gather_into_tensor(gathered, a)
            return gathered, torch.matmul(gathered.float(), b.float())
        return rs_reference(a, b, self.W, dict(v.kwargs).get("partial_dtype", "out"))

    def out_like(self, v: Variant, rows, n):
        torch = self.torch
        m = self.W * rows if v.op == "ag_gemm" else rows
        return torch.full((m, n), float("nan"), device="cuda", dtype=getattr(torch, v.dtype))

    def call(self, v: Variant, op, a, b, out=None, poison=False):
        if v.op == "ag_gemm":
            return op(a, b, poison_workspace=poison, out=out)
        return None, op(a, b, out=out)

    def verify(self, v: Variant, got, ref) -> dict:
        got_a, got_c = got
        ref_a, ref_c = ref
        if v.op == "gemm_rs":
            return compare(got_c, ref_c, slack=ref_a)
        res = compare(got_c, ref_c)
        if ref_a is not None and not self.torch.equal(got_a, ref_a):
            diff = (got_a != ref_a).any(dim=1).nonzero()
            rows = diff[:, 0].tolist()
            res["ok"] = False
            res["detail"] = (res["detail"] + "; " if res["detail"] else "") + \
                f"A_gathered differs from NCCL's all-gather in {len(rows)} row(s), first {rows[:4]}"
        return res

    def after_launch(self, op):
        st = self.state
        st.completed = op.launches
        if st.per_launch is None and op.launches == 1:
            st.per_launch = op.signal_counters()


def _fill_workspaces(env: Env, op, gen):
    for t in op.workspace_tensors().values():
        if t.is_floating_point():
            t.normal_(generator=gen)


def check_odd_m(env: Env, v: Variant) -> tuple[bool, str, float]:
    rows, k, n = env.sizes("odd_m", v)
    op = env.build(v, rows, k, n)
    worst, details = 0.0, []
    for it in range(env.args.iters):
        seed = env.args.seed * 100003 + it * 101 + env.rank
        a, b = env.inputs(v, rows, k, n, seed)
        gen = env.generator(seed + 7)
        env.barrier()                       # every rank finished the previous launch
        _fill_workspaces(env, op, gen)
        out = env.out_like(v, rows, n)
        env.barrier()                       # every workspace is noise before anyone launches
        got = env.call(v, op, a, b, out=out, poison=True)
        env.sync()
        env.after_launch(op)
        if got[1] is not out:
            details.append("the op did not write into the given output tensor")
        res = env.verify(v, got, env.reference(v, a, b))
        worst = max(worst, res["max_err"] / max(res.get("rms", 1.0), 1e-6))
        if not res["ok"]:
            details.append(f"iteration {it}: {res['detail']}")
    shape = "odd" if rows % 2 else "whole tiles per rank"
    info = f"M={rows * env.W} ({shape}) K={k} N={n}, {env.args.iters} iterations, max |err|/rms {worst:.2e}"
    return not details, info + ("; " + "; ".join(details) if details else ""), worst


def check_straggler(env: Env, v: Variant) -> tuple[bool, str, float]:
    rows, k, n = env.sizes("straggler", v)
    op = env.build(v, rows, k, n)
    worst, details, injected = 0.0, [], []
    for it in range(env.args.straggler_iters):
        rng = random.Random(env.args.seed * 7919 + it)      # the same draws on every rank
        host_rank, host_ms = rng.randrange(env.W), rng.uniform(0.0, 30.0)
        slow_rank, cycles = rng.randrange(env.W), rng.randrange(1_000_000, 20_000_000)
        comm_rank, comm_cycles = rng.randrange(env.W), rng.randrange(1_000_000, 10_000_000)
        hooks = {}
        if env.rank == host_rank:
            hooks["before_comm"] = lambda o, L, s, ms=host_ms: time.sleep(ms / 1000.0)
        if env.rank == slow_rank:
            def slow(o, L, s, c=cycles):
                env.device_sleep(s, c)
            hooks["before_compute"] = slow
        if v.sm_comm and env.rank == comm_rank:
            prev = hooks.get("before_comm")

            def slow_comm(o, L, s, c=comm_cycles, prev=prev):
                if prev is not None:
                    prev(o, L, s)
                env.device_sleep(s, c)
            hooks["before_comm"] = slow_comm
        op.hooks = hooks
        injected.append(f"host {host_rank}:{host_ms:.0f}ms gpu {slow_rank}:{cycles // 1_000_000}M"
                        + (f" comm {comm_rank}:{comm_cycles // 1_000_000}M" if v.sm_comm else ""))
        a, b = env.inputs(v, rows, k, n, env.args.seed * 31337 + it * 17 + env.rank)
        out = env.out_like(v, rows, n)
        got = env.call(v, op, a, b, out=out)
        env.sync()
        env.after_launch(op)
        op.hooks = {}
        res = env.verify(v, got, env.reference(v, a, b))
        worst = max(worst, res["max_err"] / max(res.get("rms", 1.0), 1e-6))
        if not res["ok"]:
            details.append(f"iteration {it} ({injected[-1]}): {res['detail']}")
    info = f"{env.args.straggler_iters} iterations with delays ({', '.join(injected[:3])}, ...), max |err|/rms {worst:.2e}"
    return not details, info + ("; " + "; ".join(details) if details else ""), worst


def check_back_to_back(env: Env, v: Variant) -> tuple[bool, str, float]:
    rows, k, n = env.sizes("back_to_back", v)
    op = env.build(v, rows, k, n)
    a, b = env.inputs(v, rows, k, n, env.args.seed * 65537 + env.rank)
    ref = env.reference(v, a, b)
    env.barrier()
    got = env.call(v, op, a, b)
    env.sync()
    env.barrier()                  # counters read with every rank done and none further (peers write them)
    env.after_launch(op)
    per_launch = env.state.per_launch
    N = env.args.launches
    keep_at = {1, max(1, N // 4), max(1, N // 2), max(1, 3 * N // 4), N}
    kept = {1: got}
    second = per_launch
    if N >= 2:                     # launch 2 alone too: every counter's step per launch
        env.barrier()
        got = env.call(v, op, a, b)
        env.sync()
        env.barrier()
        second = op.signal_counters()
        if 2 in keep_at:
            kept[2] = got
    env.barrier()
    t0 = time.time()
    for L in range(3, N + 1):
        got = env.call(v, op, a, b)
        if L in keep_at:
            kept[L] = got
    env.sync()
    dt = (time.time() - t0) / max(1, N - 2)
    env.barrier()                  # every rank's streams done: nothing writes the counters any more
    env.after_launch(op)
    details, worst = [], 0.0
    for L, g in sorted(kept.items()):
        res = env.verify(v, g, ref)
        worst = max(worst, res["max_err"] / max(res.get("rms", 1.0), 1e-6))
        if not res["ok"]:
            details.append(f"launch {L}: {res['detail']}")
    counters = op.signal_counters()
    for name, vals in counters.items():
        want = [x1 + (N - 1) * (x2 - x1) for x1, x2 in zip(per_launch[name], second[name])]
        if vals != want:
            bad = [i for i, (x, y) in enumerate(zip(vals, want)) if x != y]
            details.append(f"signal {name}: slots {bad[:6]} hold {[vals[i] for i in bad[:6]]}, want "
                           f"{[want[i] for i in bad[:6]]} after {N} launches (first launch: "
                           f"{[per_launch[name][i] for i in bad[:6]]})")
    info = (f"{N} launches without a sync ({dt * 1e3:.3f} ms each incl. host), outputs of launches "
            f"{sorted(kept)} checked, counters = launch 1's + (launches - 1) x one launch's step, "
            f"max |err|/rms {worst:.2e}")
    return not details, info + ("; " + "; ".join(details) if details else ""), worst


def check_streams(env: Env, v: Variant) -> tuple[bool, str, float]:
    rows, k, n = env.sizes("streams", v)
    op = env.build(v, rows, k, n)
    first = env.current_stream()
    streams = [first, env.new_stream()]
    env.device_sleep(first, 1)       # loaded before any launch (lazy loading beside a spinning kernel)
    env.barrier()
    N = env.args.stream_launches
    runs, slept = [], 0
    for L in range(1, N + 1):
        rng = random.Random(env.args.seed * 104729 + L)          # the same draws on every rank
        a, b = env.inputs(v, rows, k, n, env.args.seed * 7 + L * 13 + env.rank)
        s = streams[L % 2]
        with env.on_stream(s):
            if rng.random() < 0.3 and rng.randrange(env.W) == env.rank:
                env.device_sleep(s, rng.randrange(1_000_000, 5_000_000))   # this stream falls behind
                slept += 1
            got = env.call(v, op, a, b, out=env.out_like(v, rows, n))
        runs.append((a, b, got))
    env.sync()
    env.after_launch(op)
    worst, details = 0.0, []
    for L, (a, b, got) in enumerate(runs, start=1):
        res = env.verify(v, got, env.reference(v, a, b))
        worst = max(worst, res["max_err"] / max(res.get("rms", 1.0), 1e-6))
        if not res["ok"]:
            details.append(f"launch {L} (stream {L % 2}): {res['detail']}")
    info = (f"{N} launches alternating between two streams, {slept} behind a device sleep on this rank, every "
            f"output checked, max |err|/rms {worst:.2e}")
    return not details, info + ("; " + "; ".join(details[:4]) if details else ""), worst


CHECK_FNS = {"odd_m": check_odd_m, "straggler": check_straggler, "back_to_back": check_back_to_back,
             "streams": check_streams}


def _report_state(env: Env, why: str):
    st = env.state
    lines = [f"[rank {env.rank}] {why}"]
    op = st.op if st else None
    if op is not None:
        lines.append(f"[rank {env.rank}] {st.label}: launch {op.launches} enqueued, {st.completed} completed")
        for nm, addr, slots, note in op.signal_map():
            lines.append(map_line(env.rank, nm, addr, slots, note))
        try:
            counters = st.reader.read() if st.reader is not None else None
            why_not = "the device does not answer"
        except Exception as e:   # noqa: BLE001 - after a trap the context is gone
            counters, why_not = None, f"{type(e).__name__}: {str(e)[:200]}"
        if counters is None:
            lines.append(f"[rank {env.rank}] counters: could not be read ({why_not})")
        else:
            lines.append(f"[rank {env.rank}] counters: " + "; ".join(f"{k}={v}" for k, v in counters.items()))
            miss = missing_notifies(counters, st.per_launch, op.launches)
            if miss:
                lines.append(f"[rank {env.rank}] missing for launch {op.launches}: " + "; ".join(miss))
            elif st.per_launch is None:
                lines.append(f"[rank {env.rank}] (first launch: no per-launch counts to compare with)")
    print("\n".join(lines), flush=True)


def _watchdog(env: Env, timeout_s: float):
    def fire():
        try:
            _report_state(env, f"TIMEOUT: {env.state.label if env.state else '?'} did not finish in {timeout_s:.0f} s "
                               "(a hang: see the counters below; rerun with --debug-timeout-ns to trap the stuck wait)")
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(124)
    t = threading.Timer(timeout_s, fire)
    t.daemon = True
    return t


def _warm_up(torch):
    """Load what may later run beside a spinning kernel (CUDA lazy loading would wait for it)."""
    torch.cuda._sleep(1000)
    x = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    x.normal_()
    x.float().normal_()
    x.fill_(float("nan"))
    torch.empty_like(x).copy_(x)
    torch.cuda.synchronize()


def run(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="torchrun --nproc_per_node=W -m tldsl.checks.dist_check",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("op", nargs="?", default="all", help="ag_gemm, gemm_rs or all")
    ap.add_argument("--variants", default=None, help="comma-separated variant names (default: all of the op)")
    ap.add_argument("--checks", default=",".join(CHECKS))
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--straggler-iters", type=int, default=10)
    ap.add_argument("--launches", type=int, default=1000)
    ap.add_argument("--stream-launches", type=int, default=24, help="launches of the streams check")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per check before the watchdog reports")
    ap.add_argument("--debug-timeout-ns", type=int, default=None,
                    help="compile waits with this timeout (prints the stuck slot and traps)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args(argv)
    ops = ["ag_gemm", "gemm_rs"] if args.op == "all" else [args.op]
    checks = [c for c in args.checks.split(",") if c]
    for c in checks:
        if c not in CHECKS:
            raise SystemExit(f"unknown check {c!r}: {', '.join(CHECKS)}")
    todo = [v for o in ops for v in variants(o)]
    if args.variants:
        want = set(args.variants.split(","))
        known = {v.name for v in todo} | {v.label for v in todo}
        unknown = want - known
        if unknown:
            raise SystemExit(f"unknown variant(s) {sorted(unknown)}: {sorted(known)}")
        todo = [v for v in todo if v.name in want or v.label in want]
    if args.list:
        for v in todo:
            print(f"{v.label} ({v.dtype}): {dict(v.kwargs) or 'defaults'}")
        return 0
    if args.debug_timeout_ns:
        os.environ["TLDSL_WAIT_TIMEOUT_NS"] = str(args.debug_timeout_ns)
    import torch
    import torch.distributed as dist
    from tldsl.runtime.dist.group import init_ranks
    init_ranks()
    env = Env(args)
    _warm_up(torch)
    env.say(f"dist_check: {env.W} rank(s) on {torch.cuda.get_device_name()}, torch {torch.__version__}; "
            f"{len(todo)} variant(s) x {len(checks)} check(s)" + ("; waits time out (debug)" if env.debug else ""))
    failures = 0
    for v in todo:
        for c in checks:
            env.state = CheckState(f"{v.label} {c}")
            dog = _watchdog(env, args.timeout)
            t0 = time.time()
            dog.start()
            try:
                ok, info, _ = CHECK_FNS[c](env, v)
            except Exception as e:   # noqa: BLE001 - report, then stop: a CUDA error leaves the context unusable
                dog.cancel()
                traceback.print_exc()
                _report_state(env, f"FAIL {v.label} {c}: {type(e).__name__}: {e}")
                print(f"dist_check {v.label} {c}: FAIL on rank {env.rank} ({type(e).__name__}; the process stops: "
                      "an error on the device leaves its context unusable; a 'tldsl: wait timed out' line above is "
                      "decoded by: python -m tldsl.checks.dist_check explain LOGFILE)", flush=True)
                sys.stdout.flush()
                os._exit(1)
            dog.cancel()
            all_ok, _ = env.agree(ok)
            if not ok:
                print(f"[rank {env.rank}] {v.label} {c}: {info}", flush=True)
            env.say(f"dist_check {v.label} {c}: {'PASS' if all_ok else 'FAIL'} ({info if ok else 'see rank lines'}; "
                    f"{time.time() - t0:.1f} s)")
            failures += not all_ok
            env.state.reader = None     # (its views of the counters: symmetric memory on the fused-op runtime)
            if env.state.op is not None and hasattr(env.state.op, "close"):
                torch.cuda.synchronize()
                env.barrier()
                env.state.op.close()    # collective: the op's symmetric memory is freed here
            env.state.op = None
            gc.collect()                # the rest of the check's garbage, here where nothing spins
            torch.cuda.synchronize()
            env.barrier()
    env.say(f"dist_check: {'all passed' if not failures else f'{failures} check(s) FAILED'}")
    dist.destroy_process_group()
    return 1 if failures else 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "explain":
        if len(argv) != 2:
            raise SystemExit("usage: python -m tldsl.checks.dist_check explain LOGFILE")
        with open(argv[1], errors="replace") as f:
            lines = explain_log(f.read())
        print("\n".join(lines) if lines else "no stuck-wait or barrier-timeout lines found")
        return 0
    return run(argv)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
