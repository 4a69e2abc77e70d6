"""Role overrides: force a published role for parameters by name pattern or owning module class.

Plugins register them through ``mx_refit_register_role_overrides(register)``, recipes through
``weight_sync.role_overrides``; :meth:`mx_refit.plugins.Hooks.role_overrides` assembles both
(config wins) and the Megatron classifier consults the result. This module imports neither the
plugin manager nor the classifier, so both can depend on it.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from mx_refit.errors import ClassificationError
from mx_refit.types import Role

__all__ = ["RoleOverride", "RoleOverrides"]


@dataclass(frozen=True)
class RoleOverride:
    """Force a role for parameters matching ``pattern`` (glob on the published name) and/or
    owned by a module of class ``module_class``. ``shard_axis=None`` uses the role's axis."""

    role: Role
    pattern: str | None = None
    module_class: str | None = None
    shard_axis: int | None = None

    def matches(self, name: str, module_class: str) -> bool:
        if self.pattern is not None and not fnmatch.fnmatchcase(name, self.pattern):
            return False
        if self.module_class is not None and module_class != self.module_class:
            return False
        return True


class RoleOverrides:
    """A registry of role overrides; later registrations win, and name patterns beat classes.

    ``register`` is a plain callable so the core can hand it to plugins through the
    ``mx_refit_register_role_overrides(register)`` hook.
    """

    def __init__(self, entries: Iterable[RoleOverride] = ()) -> None:
        self._entries: list[RoleOverride] = list(entries)

    def register(
        self,
        role: Role | str,
        pattern: str | None = None,
        module_class: str | None = None,
        shard_axis: int | None = None,
    ) -> None:
        """Add an override. At least one of ``pattern`` / ``module_class`` is required."""
        try:
            role = Role(role)
        except ValueError:
            raise ClassificationError(
                f"role override role: {role!r} is not one of {[r.value for r in Role]}"
            ) from None
        if pattern is None and module_class is None:
            raise ClassificationError(
                f"role override for role {role.value!r} needs a pattern or a module_class"
            )
        if shard_axis is not None and shard_axis not in (-1, 0, 1):
            raise ClassificationError(f"role override shard_axis: {shard_axis!r} is not -1, 0 or 1")
        if role is Role.REPLICATED and shard_axis not in (None, -1):
            raise ClassificationError(
                f"role override shard_axis: {shard_axis} contradicts role 'replicated'"
            )
        self._entries.append(RoleOverride(role, pattern, module_class, shard_axis))

    def extend_from_config(self, entries: Iterable[Mapping[str, Any]]) -> None:
        """Add overrides from config dicts: ``{"role": ..., "pattern"|"module_class": ..., "shard_axis"?}``."""
        allowed = {"role", "pattern", "module_class", "shard_axis"}
        for index, entry in enumerate(entries):
            unknown = set(entry) - allowed
            if unknown:
                raise ClassificationError(
                    f"role_overrides[{index}]: unknown keys {sorted(unknown)} (allowed: {sorted(allowed)})"
                )
            if "role" not in entry:
                raise ClassificationError(f"role_overrides[{index}]: missing 'role'")
            self.register(
                entry["role"],
                pattern=entry.get("pattern"),
                module_class=entry.get("module_class"),
                shard_axis=entry.get("shard_axis"),
            )

    @classmethod
    def from_config(cls, entries: Iterable[Mapping[str, Any]]) -> RoleOverrides:
        registry = cls()
        registry.extend_from_config(entries)
        return registry

    def lookup(self, name: str, module_class: str) -> RoleOverride | None:
        """The winning override for a published name / owning class, or ``None``."""
        by_class: RoleOverride | None = None
        for entry in reversed(self._entries):
            if not entry.matches(name, module_class):
                continue
            if entry.pattern is not None:
                return entry  # the newest matching pattern wins outright
            if by_class is None:
                by_class = entry
        return by_class

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[RoleOverride]:
        return iter(self._entries)
