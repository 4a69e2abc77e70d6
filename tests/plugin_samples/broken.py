"""A plugin whose import fails, as a plugin with a missing dependency would."""

import mx_refit_this_dependency_does_not_exist  # noqa: F401
