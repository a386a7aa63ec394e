"""Kernels at the card's power limit: MoE+ReduceScatter's kernels and ``_grouped_mm`` each launched
back to back for a few seconds while ``nvidia-smi`` samples the SM clock, the power drawn and
whether the software power cap is holding the clock down.

    python -m tldsl.bench probe moe_power [--rows mixtral:32768:random,...] [--seconds 2]

Why: a grouped GEMM that runs at the power cap is paid in energy, not in SM time. Work moved
beside it (on its spare warps, on SMs its last wave leaves free, into its epilogue) still costs
its energy, and so lengthens the GEMM: what every route to hiding the combine measured
(BENCHMARKS.md, forty-eighth session). ``bench moe``'s interleaved medians, each launch after a
synchronize, cannot show this; the sustained time a launch here is what a model running the layer
back to back sees.
"""
from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

#: what nvidia-smi is asked for, in this order
SMI_QUERY = "clocks.sm,power.draw,clocks_event_reasons.sw_power_cap"
#: samples dropped at each end of a run (the clocks ramping as the loop starts and drains)
RAMP_SAMPLES = (4, 2)
SAMPLE_MS = 50


@dataclass(frozen=True)
class Sample:
    sm_mhz: float
    watts: float
    capped: bool          # the software power cap was holding the clock down


@dataclass(frozen=True)
class PowerSummary:
    samples: int
    sm_mhz_median: float
    sm_mhz_min: float
    watts_median: float
    capped: int           # samples with the software power cap active

    def cells(self) -> list[str]:
        return [f"{self.sm_mhz_median:.0f} ({self.sm_mhz_min:.0f})", f"{self.watts_median:.0f}",
                f"{self.capped} / {self.samples}"]


def parse_samples(text: str) -> list[Sample]:
    """nvidia-smi's ``--format=csv,noheader,nounits`` lines of :data:`SMI_QUERY`, the lines that
    are not three readable fields skipped (a field nvidia-smi cannot read is ``[N/A]``)."""
    out = []
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 3:
            continue
        try:
            out.append(Sample(float(fields[0]), float(fields[1]), fields[2] == "Active"))
        except ValueError:
            continue
    return out


def summarize(samples: list[Sample]) -> PowerSummary | None:
    """The medians over ``samples`` less :data:`RAMP_SAMPLES` at the ends (None: none left)."""
    head, tail = RAMP_SAMPLES
    kept = samples[head:len(samples) - tail]
    if not kept:
        return None
    clocks = [s.sm_mhz for s in kept]
    return PowerSummary(len(kept), statistics.median(clocks), min(clocks),
                        statistics.median(s.watts for s in kept), sum(s.capped for s in kept))


def smi_target(smi: str) -> str:
    """nvidia-smi's ``-i`` for torch's current device: the PCI bus id nvidia-smi lists for it where
    torch gives one (CUDA's device order need not be nvidia-smi's), else torch's index."""
    import torch
    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    bus, dev = getattr(props, "pci_bus_id", None), getattr(props, "pci_device_id", None)
    if bus is None or dev is None:
        return str(index)
    mine = f"{bus:02X}:{dev:02X}.0"
    listed = subprocess.run([smi, "--query-gpu=pci.bus_id", "--format=csv,noheader"], capture_output=True,
                            text=True).stdout.split()
    return next((b for b in listed if b.upper().endswith(mine)), str(index))


def sustained(fn, seconds: float, smi: str | None) -> tuple[float, PowerSummary | None]:
    """``fn`` launched back to back (batches of 20, a synchronize between batches) for about
    ``seconds``: ms a launch from CUDA events around the whole run, and what nvidia-smi (the
    executable ``smi``; None: not sampled) saw meanwhile."""
    import torch
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    sampler = None
    if smi is not None:
        sampler = subprocess.Popen([smi, f"--query-gpu={SMI_QUERY}", "--format=csv,noheader,nounits",
                                    "-lms", str(SAMPLE_MS), "-i", smi_target(smi)],
                                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        launches, t0 = 0, time.perf_counter()
        start.record()
        while time.perf_counter() - t0 < seconds:
            for _ in range(20):
                fn()
            launches += 20
            torch.cuda.synchronize()
        end.record()
        end.synchronize()
    finally:                    # (a kernel that fails leaves no sampler running)
        if sampler is not None:
            sampler.terminate()
    summary = summarize(parse_samples(sampler.communicate()[0])) if sampler is not None else None
    return start.elapsed_time(end) / launches, summary


def probe_moe_power(rows, seconds: float = 2.0, out=sys.stdout) -> None:
    """For each row of layer 1 (``bench moe --layer rs``'s kernels, checked against torch's
    sequence first): our grouped GEMM, ``_grouped_mm``, our combine and our GEMM then combine, each
    run back to back (:func:`sustained`), a second apart."""
    from .moe import _check_close, rs_row
    smi = shutil.which("nvidia-smi")
    print(f"# kernels launched back to back for {seconds:g} s each; nvidia-smi every {SAMPLE_MS} ms"
          + ("" if smi else " — nvidia-smi not found: times only"), file=out)
    print("| row | kernel | ms a launch | SM clock median (min), MHz | power median, W | software power cap "
          "active |", file=out)
    print("|---|---|---|---|---|---|", file=out)
    for row in rows:
        label = f"{row.model} {row.tokens} {row.routing}"
        r = rs_row(row)
        want = r.sequence()
        r.pair()
        _check_close(f"{row}: the grouped GEMM + combine differ from _grouped_mm + the weighted sum",
                     r.bufs["partial"], want)
        for name, fn in (("our grouped GEMM", r.gemm), ("`_grouped_mm`", r.gmm), ("our combine", r.combine),
                         ("our GEMM, then combine", r.pair)):
            ms, power = sustained(fn, seconds, smi)
            cells = power.cells() if power is not None else ["", "", ""]
            print(f"| {label} | {name} | {ms:.4f} | " + " | ".join(cells) + " |", file=out, flush=True)
            time.sleep(1.0)
