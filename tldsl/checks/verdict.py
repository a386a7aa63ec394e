"""The end of a torchrun check script: the ranks agree on one verdict, rank 0 prints every
case (a peer prints only its own failures), then the process group goes."""
from __future__ import annotations


def report(tag: str, results: list[tuple[str, bool, str]], device: str = "cuda") -> int:
    """``results``: ``(case, passed, detail)`` on this rank. Prints ``TAG case: PASS|FAIL [rank r]
    detail`` lines and ``TAG: all passed|FAILED``; returns the exit status (1 on any failure on
    any rank)."""
    import torch
    import torch.distributed as dist
    r = dist.get_rank()
    ok = torch.tensor([float(all(good for _, good, _ in results))], device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    for name, good, text in results:
        if r == 0 or not good:
            print(f"{tag} {name}: {'PASS' if good else 'FAIL'} [rank {r}] {text}", flush=True)
    dist.barrier()
    passed = ok.item() > 0.5
    if r == 0:
        print(f"{tag}: {'all passed' if passed else 'FAILED'}", flush=True)
    dist.destroy_process_group()
    return 0 if passed else 1


def no_flags(module: str, doc: str, argv=None) -> None:
    """The command line of a check that takes no flags: ``--help`` prints its docstring (and exits)
    and anything else is refused in one line, before torch.distributed starts."""
    import argparse
    argparse.ArgumentParser(prog=f"torchrun --nproc_per_node=2 -m tldsl.checks.{module}", description=doc,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
