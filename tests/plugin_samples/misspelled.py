"""A plugin with a hookimpl that matches no spec; check_pending() must reject it."""

from mx_refit import hookimpl


@hookimpl
def mx_refit_colect_tensors(model, mesh):
    return None
