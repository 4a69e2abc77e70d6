"""A well-formed plugin: answers target-layout queries for engines that carry ``tp``."""

from mx_refit import hookimpl
from mx_refit.types import TargetLayout


@hookimpl
def mx_refit_target_layout(engine):
    if isinstance(engine, dict) and "tp" in engine:
        return TargetLayout(tp_rank=engine["tp"][0], tp_size=engine["tp"][1], full_tensors=False)
    return None
