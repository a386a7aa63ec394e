"""AllGather+GEMM on GPUs: ``(A_gathered, A_gathered @ B)`` from each rank's rows of A — the
``allgather_gemm`` tile program, its generated GEMM waiting per tile for exactly the rows it
needs while the shards move.

Which engine makes the launches is chosen once, when the op is built (:mod:`.recipes`):

* the copy engines **pushing** the shards (:mod:`.ag_push`), the default where this rank's rows
  are whole tiles and nothing asks for the pull's options (:func:`default_push`): nothing staged,
  each rank's shard copied straight from its tensor into the peers' landing buffers, the GEMM
  storing A_gathered as it loads;
* the copy engines **pulling** them (:mod:`.ag_pull`) elsewhere: the shard staged in a symmetric
  slot (by the GEMM, :func:`default_staging`, or one kernel pass), the peers' copies after a
  device-side handshake;
* every other schedule — the generated all-gather kernel on ``sms`` reserved SMs
  (``engine="sm"``, push or pull), the codegen copy-engine plan (``ce_executor="plan"``, and a push
  whose rows are not whole tiles) — is the tile program run by the fused-op runtime
  (:class:`_ProgramAllGather`, :mod:`.program_engine`).

CUDA graphs (every engine): the launch number reaches the device as kernel arguments, memop
constants and slot addresses, all baked into a captured graph, so a captured call (and every call
of an op once captured) is launch ``L = 1`` of fresh counters reset on the device between two
group barriers (:mod:`.fused_op`).
"""
from __future__ import annotations

import dataclasses

from ... import env
from ...errors import InputError
from ...ir.schedule import CommSchedule, ComputeSchedule
from ..gpu.launch import LaunchCache
from .call_order import CallOrder
from ...ops.weights import check_weight_layout
from .recipes import choose
from .spare_outputs import keep_spares
from .group import built_alike, dist_context, dtype_name
from .operands import (check_open, check_operands, check_output, check_progress, check_schedules, check_sizes,
                       dense)
from .engine import EngineOp
from .program_engine import ProgramEngine
from .symmetric import Lease

DEFAULT_COMPUTE = ComputeSchedule(tile=(128, 256, 64), stages=4, order="comm_aligned")


class AllGatherMatmul(EngineOp):
    """``(A_gathered, A_gathered @ B)`` for a fixed (rows per rank, K, N, dtype).

    Building it is collective (symmetric allocation + rendezvous): every rank of ``group``
    must build it, in the same order as any other collective."""

    def __init__(self, rows_per_rank: int, k: int, n: int, dtype="bfloat16", *, group=None,
                 compute: ComputeSchedule | None = None, comm: CommSchedule | None = None, progress=None,
                 engine: str | None = None, sms: int | None = None, ce_executor: str | None = None,
                 handshake: str | None = None, enqueue: str = "gemm_first", staging: str | None = None,
                 stage_waves: int | None = None, spare_outputs: bool | None = None, pusher: str | None = None,
                 weights: str = "kn"):
        """``engine``: ``None`` / ``"copy_engine"`` (default: the copy engines push where this
        rank's rows are whole tiles and no pull option is given — :func:`default_push` — and pull
        elsewhere) or ``"sm"`` (the generated all-gather kernel on ``sms`` SMs, default 8, the
        GEMM on the others); ``comm`` gives a full schedule instead. ``ce_executor``: ``"direct"`` (the
        measured copy-engine pull path) or ``"plan"`` (the codegen copy-engine plan through
        :class:`~.plan_exec.PlanExecutor`); default: direct, except copy-engine push where this
        rank's rows are not whole tiles (or with clusters), which only the plan runs — the direct
        push is :class:`~.ag_push.PushAllGather`. ``weights``: ``"kn"`` (B is ``[K, N]``) or ``"nk"``
        (B is ``[N, K]``, a torch Linear's weight, read K-major by the GEMM with no copy: the op's tile
        program on the fused-op runtime — the SM schedules or the copy-engine plan — as the direct
        paths take B ``[K, N]`` only). ``handshake`` (the
        direct path's one barrier per launch): ``"device"`` (the default with the staging kernel:
        that kernel publishes the launch number into this rank's slot on every peer once the
        shard is staged, and the copy stream waits for each peer's slot with a stream memory
        operation), ``"memops"`` (the default with ``staging="copies"``: stream memory operations
        only — the copy stream writes the launch number into a symmetric slot on every peer and
        waits for theirs; neither uses a kernel of its own or an SM, so the GEMM gets every SM)
        or ``"kernel"`` (torch symmetric memory's barrier kernel, on one SM kept free of the GEMM).
        ``enqueue`` (the direct path's host order): ``"gemm_first"`` (the GEMM, then the
        handshake and copies) or ``"comm_first"`` (the reverse: peers' shards move one GEMM launch
        earlier, the GEMM starts one handshake later). ``staging`` (the direct path): ``"kernel"``
        (one pass of :mod:`.staging`'s kernel writes the shard into its symmetric slot and into
        this rank's rows of A_gathered, and this rank's flag), ``"gemm"`` (no pass before the GEMM:
        the GEMM reads this rank's rows from the shard and stores them, as it loads them, into the
        slot and A_gathered — ``tldsl::sm90::OwnRows``; whole tiles of rows per rank, no clusters)
        or ``"copies"`` (two ``cuMemcpyAsync`` and a stream write); default: :func:`default_staging`.
        ``stage_waves`` (``staging="gemm"``): over how many waves of tiles the GEMM spreads the
        staging (default :data:`STAGE_WAVES`; :func:`stage_columns`). ``spare_outputs`` (the
        direct copy-engine push and pull): each call ends by allocating the next call's A_gathered and C,
        so the next GEMM is handed to the driver without waiting for the allocator
        (:mod:`.spare_outputs`); ``None`` (default): where both together are at most
        :data:`~.spare_outputs.SPARE_LIMIT_BYTES`. ``pusher`` (the direct copy-engine push): who writes
        this rank's shard into the peers — ``"copy_engine"`` (default) or ``"gemm"`` (the GEMM as it
        loads it: :class:`~.ag_push.PushAllGather`; correct on GPUs but slower: ``probe ag_push``).
        The default push moves each shard in column slices (:func:`default_col_tile`; a ``comm``
        with its own ``col_tile`` decides by hand)."""
        import torch

        with built_alike("AllGatherMatmul", group) as build:      # every rank leaves it alike (group.py)
            check_weight_layout("AllGatherMatmul", weights)
            self.weights = weights
            check_sizes("AllGatherMatmul", rows_per_rank=rows_per_rank, k=k, n=n)
            check_schedules("AllGatherMatmul", compute, comm)
            check_progress("AllGatherMatmul", progress)
            check_sizes("AllGatherMatmul", **{name: v for name, v in (("sms", sms), ("stage_waves", stage_waves))
                                              if v is not None})          # (None: the default)
            if pusher not in (None, "copy_engine", "gemm"):
                raise InputError(f"AllGatherMatmul: pusher={pusher!r}: choose 'copy_engine' or 'gemm'")
            if k % 8 or n % 8:
                raise InputError(f"AllGatherMatmul: K={k} and N={n} must be multiples of 8 (A's, B's and C's rows "
                                 f"whole 16-byte units for TMA)")
            self._closed = False
            self.ctx = dist_context(group)
            W = self.ctx.world_size
            self.Ms, self.K, self.N = int(rows_per_rank), int(k), int(n)
            tdtype = torch.bfloat16 if dtype_name(dtype, "AllGather+GEMM") == "bf16" else torch.float16
            self.dtype = tdtype
            keep_spares(spare_outputs, 0)       # (its type checked before anything is built)
            if comm is None and default_push(self.Ms, compute, engine, sms, ce_executor, staging, handshake,
                                             stage_waves):
                comm = push_comm(self.K, compute, pusher)
            comm = resolve_comm(comm, engine, sms, compute or DEFAULT_COMPUTE)
            if comm.engine not in ("copy_engine", "sm"):
                raise InputError(f"AllGatherMatmul on GPUs runs the copy-engine and SM schedules; got {comm} (the "
                                 f"GEMM pushing the shards is pusher='gemm')")
            self.hooks: dict = {}
            self.timeline = None        # a PhaseTimeline: the next calls mark their phases on it
            self._engine = None
            if ce_executor not in (None, "direct", "plan"):
                raise InputError(f"ce_executor={ce_executor!r}: choose 'direct' or 'plan'")
            c0 = compute or DEFAULT_COMPUTE
            push = comm.engine == "copy_engine" and comm.mode == "push"
            if weights == "nk" and ce_executor == "direct":
                raise InputError("AllGatherMatmul: weights='nk': the direct copy-engine path takes B [K, N]; B [N, K] "
                                 "runs on the fused-op runtime (ce_executor='plan', or engine='sm')")
            if ce_executor is None:
                ce_executor = "plan" if push and (self.Ms % c0.BM or c0.cluster != (1, 1)) else "direct"
            staging_given = staging
            if staging is None:
                staging, planned_waves = default_staging(self.Ms, self.N, self.K, W, compute, comm, handshake, enqueue,
                                                         ce_executor)
                if staging == "gemm" and stage_waves is None and weights == "kn":   # (nk: no direct path)
                    stage_waves = planned_waves
            if handshake not in (None, "kernel", "memops", "device"):
                raise InputError(f"handshake={handshake!r}: choose 'memops', 'device' or 'kernel'")
            if handshake == "device" and staging == "copies":
                raise InputError(f"handshake='device' is the staging kernel's own handshake; staging={staging!r} "
                                 f"has none")
            if enqueue not in ("gemm_first", "comm_first"):
                raise InputError(f"enqueue={enqueue!r}: choose 'gemm_first' or 'comm_first'")
            if staging not in ("kernel", "copies", "gemm"):
                raise InputError(f"staging={staging!r}: choose 'kernel', 'copies' or 'gemm'")
            if stage_waves is not None and staging != "gemm":
                raise InputError(f"stage_waves={stage_waves!r}: a positive int, with staging='gemm' (got {staging!r})")
            if staging == "gemm":
                if handshake not in (None, "device"):
                    raise InputError(f"staging='gemm': the GEMM publishes the launch's arrival itself (handshake "
                                     f"'device'), not {handshake!r}")
                bm = (compute or DEFAULT_COMPUTE).BM
                if self.Ms % bm or (compute is not None and compute.cluster != (1, 1)):
                    raise InputError(f"staging='gemm': this rank's {self.Ms} rows must be whole {bm}-row tiles and the "
                                     f"GEMM must run without clusters; use staging='kernel'")
                if enqueue != "gemm_first":
                    raise InputError("staging='gemm': nothing is staged before the GEMM, so the GEMM goes first")
            self.enqueue, self.staging = enqueue, staging
            build.config = dict(    # as given where the op treats "not given" apart (compute, staging)
                rows_per_rank=self.Ms, K=self.K, N=self.N, dtype=tdtype, compute=compute, comm=comm,
                ce_executor=ce_executor, staging=staging, staging_given=staging_given, handshake=handshake,
                enqueue=enqueue, pusher=pusher, stage_waves=stage_waves, spare_outputs=spare_outputs)
        # every symmetric block of the op, from here on: freed by close() only (symmetric.py)
        self._lease = Lease(self.ctx, f"AllGatherMatmul({self.Ms}, {self.K}, {self.N})", self)
        timeout = env.wait_timeout_ns()     # TLDSL_WAIT_TIMEOUT_NS (debug: a wait that spins too long reports and traps)
        self.comm, self.handshake = comm, None
        self.compute = compute or DEFAULT_COMPUTE       # (the pull / push engine may refine it: their docstrings)
        self.launches, self.debug = 0, bool(env.get("TLDSL_DEBUG"))
        options = BuildOptions(compute_given=compute is not None, handshake=handshake, staging=staging,
                               staging_given=staging_given, stage_waves=stage_waves, enqueue=enqueue,
                               spare_outputs=spare_outputs, pusher=pusher, ce_executor=ce_executor,
                               wait_timeout_ns=timeout)
        recipe = choose("AllGatherMatmul", comm, ce_executor)
        if weights == "nk":         # the direct paths take B [K, N] only: the tile program on the runtime
            recipe = None
        engine_cls = _ProgramAllGather if recipe is None else recipe.engine_class()
        self._engine = engine_cls(self, progress, options)

    @property
    def b_shape(self) -> tuple[int, int]:
        """B as the op takes it: ``(K, N)``, or ``(N, K)`` with ``weights="nk"``."""
        return (self.N, self.K) if self.weights == "nk" else (self.K, self.N)

    def _check(self, a_shard, b):
        """Every problem with the operands, before anything is enqueued (the A shard may be a
        strided or unaligned view: the op copies it first)."""
        check_open("AllGatherMatmul", self._closed)
        check_operands("AllGatherMatmul", (("A shard", a_shard, (self.Ms, self.K)), ("B", b, self.b_shape)),
                       self.dtype, self.ctx.device, strided_ok=("A shard",))

    def __call__(self, a_shard, b, *, poison_workspace: bool = False, out=None, return_gathered: bool = True):
        """``(A_gathered, C)``. ``out``: optional C tensor to write ([W*Ms, N], contiguous).
        ``return_gathered=False``: ``(None, C)`` — on the schedules the fused-op runtime runs,
        the gathered rows then stay in the op's buffer, not copied out of it (the hand-built
        paths gather into a tensor of the call's own: nothing to save there)."""
        a_full, c = self._engine(a_shard, b, poison_workspace=poison_workspace, out=out,
                                 return_gathered=bool(return_gathered))
        return (a_full if return_gathered else None), c

    def _check_out(self, out, a_shard, b):
        check_output("AllGatherMatmul", out, (self.ctx.world_size * self.Ms, self.N), self.dtype, self.ctx.device,
                     (("the A shard", a_shard), ("B", b)))

    def compute_only(self, a_gathered, b, *, out=None):
        """Only this op's GEMM (same kernel, schedule and SM count) on an already gathered A,
        its waits satisfied by scratch counters: what the fused op would cost if communication
        were free. For benchmarks and diagnosis; the op's own counters are not touched. Its host
        path is as lean as the op's (checks, one allocation, one driver call), so that timing it
        beside the op compares the GPUs' work."""
        import torch
        check_open("AllGatherMatmul", self._closed)
        W = self.ctx.world_size
        want = (W * self.Ms, self.K)
        if not isinstance(a_gathered, torch.Tensor) or a_gathered.shape != want or \
                a_gathered.dtype != self.dtype or not a_gathered.is_contiguous():
            raise InputError(f"A_gathered must be a contiguous {want} tensor of {self.dtype}")
        if not isinstance(b, torch.Tensor) or b.shape != self.b_shape or b.dtype != self.dtype or \
                b.get_device() != self.ctx.device or \
                a_gathered.get_device() != self.ctx.device or not b.is_contiguous():
            self._check(a_gathered[:self.Ms], b)
        c = torch.empty((W * self.Ms, self.N), dtype=self.dtype, device=a_gathered.device) if out is None else out
        if getattr(self, "_compute_only", None) is None:
            self._compute_only = LaunchCache()
        self._compute_only.get((a_gathered.data_ptr(), b.data_ptr(), c.data_ptr()),
                               lambda: self._prepare_compute_only(a_gathered, b, c)).launch(
            torch.cuda.current_stream(self.ctx.device).cuda_stream, 1)      # launched like the fused op's GEMM
        return c

    def _prepare_compute_only(self, a_gathered, b, c):
        """The GEMM alone's prepared launch: scratch counters that satisfy every wait, and the
        engine's scratch for what its GEMM stores besides C (:meth:`~.engine.Engine.compute_only_inputs`)."""
        import torch
        engine = self._engine
        slots = engine.signals[engine.signal].numel()
        if getattr(self, "_scratch", None) is None or self._scratch.numel() != slots:
            self._scratch = torch.full((slots,), 1 << 40, dtype=torch.int64, device=a_gathered.device)
        buffers, signals = {"a_gathered": a_gathered, "b": b, "c": c}, {engine.signal: self._scratch}
        extra_buffers, extra_signals = engine.compute_only_inputs(a_gathered)
        buffers.update(extra_buffers)
        signals.update(extra_signals)
        return engine.compute_gemm.prepare(buffers, signals=signals, rank=self.ctx.rank, hold=False)

    # -- what FusedOp's repr, card and describe() say of it ----------------------------------------
    def _problem(self) -> str:
        b = f"B [{self.N}, {self.K}]^T" if self.weights == "nk" else f"B [{self.K}, {self.N}]"
        return f"A shard [{self.Ms}, {self.K}] @ {b} {self.dtype}"

    def _facts(self) -> list:
        return [("A shard", [self.Ms, self.K]), ("B", list(self.b_shape)), ("dtype", self.dtype),
                ("engine", self.engine)]


@dataclasses.dataclass(frozen=True)
class BuildOptions:
    """The op's options as resolved before its first collective allocation, for its engine: each
    engine takes the ones that apply to it and refuses the others (with an InputError naming them)."""

    compute_given: bool
    handshake: str | None
    staging: str | None
    staging_given: str | None
    stage_waves: int | None
    enqueue: str
    spare_outputs: bool | None
    pusher: str | None
    ce_executor: str
    wait_timeout_ns: int | None

    def refuse_pusher(self, comm: CommSchedule) -> None:
        """An engine other than the direct push: ``pusher`` is not an option of ``comm``."""
        if self.pusher is not None:
            raise InputError(f"pusher={self.pusher!r}: only the direct copy-engine push has a pusher to choose "
                             f"(this schedule: {comm}, ce_executor={self.ce_executor!r})")


DEFAULT_SM_LANES = 8

#: staging="gemm": the staging is spread over the tile columns of this many waves of the GEMM
#: (``probe ag_staging``: one wave as fast as two or faster, and the shard reaches the peers earlier)
STAGE_WAVES = 1
#: the machine figures the default staging is planned with (2x H200): NVLink copy-engine
#: bandwidth one way (BENCHMARKS.md, 366 GB/s) and dense bf16 FLOP/s per SM (cuBLAS ~764 TFLOP/s
#: over 132 SMs)
NVLINK_BYTES_PER_S = 366e9
SM_FLOPS = 5.8e12


#: the copy-engine push schedule (the direct path, :mod:`.ag_push`)
PUSH = CommSchedule(engine="copy_engine", mode="push", order="ring")


#: columns per slice of the default push (``CommSchedule.col_tile``): measured (BENCHMARKS.md) as
#: fast as whole shards or faster (``probe ag_slices``; 2048 columns within noise of it) and less
#: slowed where a peer starts late (``probe ag_skew`` at 2048x8192x8192, a peer 30-40 us late:
#: +23 us, whole shards +40 us); every benchmark row <= 1.05x ideal in five full runs with it
DEFAULT_COL_TILE = 1024


def default_col_tile(k: int, compute: ComputeSchedule) -> int | None:
    """The default push's column slices: :data:`DEFAULT_COL_TILE` columns where the shard is wider
    and the compute tile's K step divides it; whole shards (None) otherwise."""
    if k <= DEFAULT_COL_TILE or DEFAULT_COL_TILE % compute.BK:
        return None
    return DEFAULT_COL_TILE


def push_comm(k: int, compute: ComputeSchedule | None, pusher: str | None = None) -> CommSchedule:
    """The default push's communication schedule: whole shards where the GEMM pushes them
    (``pusher="gemm"``), else the copy engines' column slices (:func:`default_col_tile`)."""
    return PUSH if pusher == "gemm" else PUSH.with_(col_tile=default_col_tile(k, compute or DEFAULT_COMPUTE))


def default_comm(rows_per_rank: int, k: int, compute: ComputeSchedule | None = None, *,
                 pusher: str | None = None, handshake: str | None = None) -> CommSchedule:
    """The communication schedule of an op built with no ``comm`` (and these options): the push
    where :func:`default_push` allows it, else the copy-engine pull."""
    if default_push(rows_per_rank, compute, None, None, None, None, handshake, None):
        return push_comm(k, compute, pusher)
    return resolve_comm(None, None, None, compute or DEFAULT_COMPUTE)


def default_push(rows_per_rank: int, compute: ComputeSchedule | None, engine, sms, ce_executor, staging, handshake,
                 stage_waves) -> bool:
    """Whether an op built without a communication schedule pushes: the direct copy-engine push
    runs where this rank's rows are whole tiles and the GEMM has no clusters, and nothing asks
    for the pull path's own options (staging, handshake, the plan executor, SMs). Measured
    (``probe ag_push``, BENCHMARKS.md): faster than or equal to the pull at every benchmark shape,
    up to 10% at the smallest."""
    c = compute or DEFAULT_COMPUTE
    pull_options = (staging, handshake, stage_waves, sms)
    return (engine in (None, "copy_engine") and ce_executor != "plan" and all(o is None for o in pull_options)
            and rows_per_rank % c.BM == 0 and c.cluster == (1, 1))


def default_staging(rows_per_rank: int, n: int, k: int, world_size: int, compute: ComputeSchedule | None,
                    comm: CommSchedule, handshake, enqueue: str, ce_executor: str) -> tuple[str, int | None]:
    """``("gemm", waves)`` where the GEMM can stage this rank's rows (the direct copy-engine pull
    path, whole tiles of rows per rank, no clusters, the GEMM enqueued first, the ``comm_aligned``
    order that computes this rank's rows first, in one group — the default schedule for this
    staging) and the shard, staged over the GEMM's first :data:`STAGE_WAVES` waves of tiles and
    then copied, still reaches the peers before they have computed their own rows (half of the
    GEMM's waves; times in tile times, with a tenth of one to spare); ``("kernel", None)``
    otherwise. Measured (``probe ag_staging``): the GEMM staging is faster exactly where this
    holds."""
    from ..gpu.device import sm_count
    c = compute or DEFAULT_COMPUTE
    direct = comm.engine == "copy_engine" and comm.mode == "pull" and ce_executor == "direct"
    if not direct or handshake not in (None, "device") or enqueue != "gemm_first" or rows_per_rank % c.BM \
            or c.cluster != (1, 1) or c.order != "comm_aligned":    # (this rank's rows first: the plan's premise)
        return "kernel", None
    if compute is not None and compute.group_m * c.BM < rows_per_rank:
        return "kernel", None       # a given schedule whose first wave does not reach all of this rank's rows
    tiles = -(-world_size * rows_per_rank // c.BM) * -(-n // c.BN)
    half = tiles / sm_count() / 2                                   # waves before the peers need the shard
    tile_s = 2 * c.BM * c.BN * k / SM_FLOPS
    copy = rows_per_rank * k * 2 / NVLINK_BYTES_PER_S / tile_s      # the copy, in tile times
    if half >= STAGE_WAVES + copy + 0.1:
        return "gemm", STAGE_WAVES
    return "kernel", None


def stage_columns(rows_per_rank: int, n: int, compute: ComputeSchedule, ctas: int, waves: int = STAGE_WAVES) -> int:
    """staging="gemm": how many tile columns of each of this rank's tile rows share its staging
    (column j stores the A stages k with k % cols == j). With all of this rank's tile rows in one
    group of the order, the first ``ctas`` tiles cover ``ctas // rows`` columns of every row: the
    staging is spread over the first ``waves`` waves of tiles — few enough that the shard is
    published early in the GEMM, enough that no tile adds much store traffic to its own."""
    tile_rows = -(-rows_per_rank // compute.BM)
    tile_cols = -(-n // compute.BN)
    return max(1, min(tile_cols, waves * ctas // tile_rows))


def resolve_comm(comm: CommSchedule | None, engine: str | None, sms: int | None,
                 compute: ComputeSchedule) -> CommSchedule:
    """The communication schedule from ``comm`` and / or the ``engine`` / ``sms`` shortcuts."""
    if engine not in (None, "copy_engine", "sm"):
        raise InputError(f"engine={engine!r}: choose 'copy_engine' or 'sm'")
    if comm is not None:
        if engine is not None and comm.engine != engine:
            raise InputError(f"engine={engine!r} contradicts the communication schedule {comm}")
        if sms is not None and comm.sms != sms:
            raise InputError(f"sms={sms} contradicts the communication schedule {comm}")
        return comm
    if engine == "sm":
        return CommSchedule(engine="sm", mode="pull", order="ring", tile_m=compute.BM,
                            sms=DEFAULT_SM_LANES if sms is None else sms)
    if sms is not None:
        raise InputError(f"sms={sms}: the copy engine uses no SMs (pass engine='sm')")
    return CommSchedule(engine="copy_engine", mode="pull", order="ring")


class _ProgramAllGather(ProgramEngine):
    """AG+GEMM's schedules without a direct path — the generated all-gather kernel on ``sms``
    reserved SMs (``engine='sm'``, push or pull) and the codegen copy-engine plan (``ce_executor=
    'plan'``, and a push whose rows are not whole tiles) — as the ``allgather_gemm`` tile program
    on the fused-op runtime (:mod:`.program_engine`): its protocol (entry handshake, every part
    with the launch's epoch, exit handshake) is :class:`~.program_op.FusedProgram` 's. The
    gathered rows land in the program's symmetric ``a_gathered``; each call returns a copy of
    them (the next launch overwrites the buffer), or nothing where the caller does not want them."""

    def __init__(self, op, progress, options: BuildOptions):
        import weakref
        import torch
        import tldsl as tl
        from ...ops.allgather_gemm import allgather_gemm
        ce_executor = options.ce_executor
        options.refuse_pusher(op.comm)
        if options.spare_outputs:
            raise InputError("spare_outputs=True: the direct copy-engine push and pull keep spare outputs; "
                             f"this schedule ({op.comm}, ce_executor={ce_executor!r}) allocates per call")
        if options.handshake is not None:
            raise InputError(f"handshake={options.handshake!r} applies to the direct copy-engine pull path; this "
                             f"schedule ({op.comm}, ce_executor={ce_executor!r}) runs on the fused-op runtime, whose "
                             f"handshakes are stream memory operations")
        for what, given in (("staging", options.staging_given), ("stage_waves", options.stage_waves),
                            ("enqueue", None if options.enqueue == "gemm_first" else options.enqueue)):
            if given is not None:       # (the direct paths' options: silently ignored here before)
                raise InputError(f"{what}={given!r} applies to the direct copy-engine paths; this schedule "
                                 f"({op.comm}, ce_executor={ce_executor!r}) runs on the fused-op runtime, which "
                                 "stages nothing and enqueues every part at once")
        self.op = weakref.proxy(op)         # no cycle: a dropped op goes at once (its lease warns)
        self.mode = op.comm.mode
        W = op.ctx.world_size
        dt = tl.bfloat16 if op.dtype == torch.bfloat16 else tl.float16
        spec = tl.TensorSpec
        super().__init__(op, allgather_gemm, {"a": spec((op.Ms, op.K), dt), "b": spec(op.b_shape, dt),
                                              "c": spec((W * op.Ms, op.N), dt)},
                         name="sm" if op.comm.engine == "sm" else "copy_engine-plan", progress=progress,
                         compute=op.compute, comm=op.comm, weights=op.weights)
        op.ir, op.lowered = self.ir, self.lowered("gemm")
        (self.signal,) = op.lowered.signals
        self._gemm = None
        self._order = CallOrder()

    @property
    def compute_gemm(self):
        """The program's GEMM as a stand-alone kernel on the SMs it gets in the fused launch
        (``AllGatherMatmul.compute_only``)."""
        if self._gemm is None:
            from ..gpu.gemm import GemmKernel
            self._gemm = GemmKernel(self.lowered("gemm"), reserve_sms=self.reserved_sms("gemm"))
        return self._gemm

    def __call__(self, a_shard, b, *, poison_workspace: bool = False, return_gathered: bool = True, out=None):
        import torch
        op = self.op
        op._check(a_shard, b)
        if out is not None:
            op._check_out(out, a_shard, b)
        gathered = self.workspace_tensors()["a_gathered"]
        # after the previous call, whatever its stream: the program orders its launches, but this
        # call's poisoning and the previous call's copy of the gathered rows are the op's own
        self._order.follow(self.program.device.origin())
        if poison_workspace:
            gathered.fill_(float("nan"))
        c = out if out is not None else torch.empty((op.ctx.world_size * op.Ms, op.N), dtype=op.dtype,
                                                    device=gathered.device)
        super().__call__(op, a=dense(a_shard), b=b, c=c)
        if op.debug and not op._capture:
            torch.cuda.synchronize()
            print(f"[rank {op.ctx.rank}] ag_gemm {self.name}-{self.mode} launch {op.launches}: done; counters "
                  f"{self.program.signal_counters()}", flush=True)
        return (gathered.clone() if return_gathered else None), c
