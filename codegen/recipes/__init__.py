"""Recipes: the kernels the pipeline can build, one module each, in one table.

The pipeline (:mod:`tldsl.codegen.pipeline`) tries the recipes of a part's role by
``priority``, highest first. A new kind of kernel costs its matcher (``match/``), its planner
(``plan/``), its recipe module here (the renderer and the :class:`Recipe`) and one line in
:data:`RECIPES`.
"""
from __future__ import annotations

from .recipe import Recipe
from . import attention, combine, copy_engine, gemm, general, grouped_gemm, sm_comm

#: every recipe, the pipeline's one table
RECIPES: tuple[Recipe, ...] = (gemm.RECIPE, grouped_gemm.RECIPE, combine.RECIPE, attention.RECIPE, sm_comm.RECIPE,
                               copy_engine.RECIPE, general.RECIPE, general.RECIPE_COMM)

__all__ = ["Recipe", "RECIPES"]
