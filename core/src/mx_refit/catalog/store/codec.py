"""Generic JSON encoding of the catalog state for stores that keep it outside the process.

Nothing here knows the catalog's classes: any dataclass, enum or NamedTuple defined under ``mx_refit`` is
encoded field by field (fields with ``metadata=TRANSIENT`` are skipped, and a class may define
``__post_load__`` to rebuild them), so a field that someone adds to a record is stored with no
extra code. Shared objects stay shared (a lease and its version's lease table point at the same
record), cycles included.

A field whose metadata has ``immutable_values`` (see ``IMMUTABLE_VALUES`` in
``mx_refit.catalog._records``) holds a dict whose values are never mutated once inserted: each
value is treated as immutable. Immutable values (frozen dataclasses, strings, those dict values)
whose encoding exceeds :data:`BLOB_MIN_CHARS`
become *blobs*: stored once under a content-addressed key, referenced by that key from the
document. Each one is encoded once per process (memoised by identity), so re-encoding a
document whose big parts did not change costs only its small mutable parts.
"""

from __future__ import annotations

import base64
import dataclasses
import enum
import hashlib
import importlib
import json
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

__all__ = ["BLOB_MIN_CHARS", "StateCodec"]

BLOB_MIN_CHARS = 1024
_ALLOWED_PREFIX = "mx_refit."


def _class_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _resolve_class(name: str) -> type:
    module, _, qualname = name.partition(":")
    if not module.startswith(_ALLOWED_PREFIX):
        raise ValueError(f"stored state names class {name!r} outside {_ALLOWED_PREFIX}*")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not (isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)
                                       or (issubclass(obj, tuple) and hasattr(obj, "_fields")))):
        raise ValueError(f"stored state names {name!r}, which is neither a dataclass, an enum nor a NamedTuple")
    return obj


def _stored_fields(cls: type) -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(cls) if not f.metadata.get("transient")]


class StateCodec:
    """Encodes a state graph to a JSON document plus blobs, and decodes it back.

    :param blob_prefix: prepended to every blob's content hash to make its key.
    """

    def __init__(self, blob_prefix: str) -> None:
        self.blob_prefix = blob_prefix
        # id(blob object) -> (object, its reference, its blob text); the object is
        # held so that the id stays its own
        self._memo: dict[int, tuple[Any, Any, str]] = {}

    # --- encoding ------------------------------------------------------------------------

    def encode(self, root: Any) -> tuple[str, dict[str, str]]:
        """``(document, blobs)``: ``blobs`` maps the key of every blob the document references
        to its text."""
        ids: dict[int, int] = {}
        blobs: dict[str, str] = {}
        used: dict[int, tuple[Any, Any, str]] = {}

        def enc(value: Any, flat: bool = False) -> Any:
            # flat: inside an immutable value's own encoding, where nothing becomes a blob (a blob
            # is one self-contained text) and nothing is shared.
            if value is None or isinstance(value, (bool, int, float)):
                return value
            if isinstance(value, enum.Enum):
                return {"e": _class_name(type(value)), "v": value.value}
            if isinstance(value, str):
                return value if flat or len(value) < BLOB_MIN_CHARS else immutable(value)
            if isinstance(value, bytes):
                return {"y": base64.b64encode(value).decode("ascii")}
            if dataclasses.is_dataclass(value) and not isinstance(value, type):
                params = type(value).__dataclass_params__  # type: ignore[attr-defined]
                if params.frozen:
                    return inline(value) if flat else immutable(value)
                if flat:
                    raise TypeError(f"a frozen value holds a mutable {type(value).__name__}: it cannot be stored")
                ref = ids.get(id(value))
                if ref is not None:
                    return {"r": ref}
                ids[id(value)] = ref = len(ids)
                return {"c": _class_name(type(value)), "i": ref, "f": fields_of(value, False)}
            if isinstance(value, OrderedDict):
                return {"o": [[enc(k, flat), enc(v, flat)] for k, v in value.items()]}
            if isinstance(value, dict):
                if all(type(k) is str for k in value):
                    return {"d": {k: enc(v, flat) for k, v in value.items()}}
                return {"k": [[enc(k, flat), enc(v, flat)] for k, v in value.items()]}
            if isinstance(value, tuple):
                if type(value) is not tuple:  # a NamedTuple: keep its type
                    return {"n": _class_name(type(value)), "t": [enc(v, flat) for v in value]}
                return {"t": [enc(v, flat) for v in value]}
            if isinstance(value, list):
                return [enc(v, flat) for v in value]
            if isinstance(value, (set, frozenset)):
                items = sorted((enc(v, flat) for v in value), key=lambda e: json.dumps(e, sort_keys=True))
                return {"s" if isinstance(value, set) else "z": items}
            raise TypeError(f"cannot store a {type(value).__name__} in the catalog state: {value!r:.80}")

        def fields_of(value: Any, flat: bool) -> dict[str, Any]:
            out = {}
            for f in _stored_fields(type(value)):
                item = getattr(value, f.name)
                if (not flat and f.metadata.get("immutable_values") and isinstance(item, dict)
                        and all(type(k) is str for k in item)):
                    out[f.name] = {"d": {k: immutable(v) for k, v in item.items()}}
                else:
                    out[f.name] = enc(item, flat)
            return out

        def inline(value: Any) -> dict[str, Any]:
            return {"c": _class_name(type(value)), "f": fields_of(value, True)}

        def immutable(value: Any) -> Any:
            memo = self._memo.get(id(value))
            if memo is None or memo[0] is not value:
                if isinstance(value, str):
                    memo = self._blob(value, "s" + value)
                else:
                    is_dataclass = dataclasses.is_dataclass(value)
                    encoded = inline(value) if is_dataclass else enc(value, True)
                    text = json.dumps(encoded, separators=(",", ":"))
                    if len(text) < BLOB_MIN_CHARS:
                        return encoded  # small: inline, not memoised
                    memo = self._blob(value, "j" + text)
            used[id(value)] = memo
            blobs[memo[1]["b"]] = memo[2]
            return memo[1]

        encoded_root = enc(root)
        document = json.dumps({"root": encoded_root, "blobs": sorted(blobs)}, separators=(",", ":"))
        self._memo = used
        return document, blobs

    def _blob(self, value: Any, text: str) -> tuple[Any, Any, str]:
        key = self.blob_prefix + hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
        return (value, {"b": key}, text)

    # --- decoding ------------------------------------------------------------------------

    @staticmethod
    def blob_keys(document: str) -> list[str]:
        """Keys of the blobs ``document`` references (to fetch those not cached yet)."""
        return list(json.loads(document)["blobs"])

    def cached_blobs(self) -> set[str]:
        """Keys whose decoded objects this codec still holds (need not be fetched again)."""
        return {memo[1]["b"] for memo in self._memo.values()}

    def decode(self, document: str, blobs: Mapping[str, str]) -> Any:
        """The state graph of ``document``; ``blobs`` must hold the text of every blob it
        references. Immutable objects decoded from the same blob text as before are reused."""
        objects: dict[int, Any] = {}
        loaded: list[Any] = []
        decoded_blobs: dict[str, tuple[Any, Any, str]] = {}
        previous = {memo[1]["b"]: memo for memo in self._memo.values()}
        used: dict[int, tuple[Any, Any, str]] = {}

        def dec(node: Any) -> Any:
            if node is None or isinstance(node, (bool, int, float, str)):
                return node
            if isinstance(node, list):
                return [dec(v) for v in node]
            if "b" in node:
                key = node["b"]
                memo = decoded_blobs.get(key) or previous.get(key)
                if memo is None:
                    text = blobs[key]
                    value = text[1:] if text[0] == "s" else dec(json.loads(text[1:]))
                    memo = (value, {"b": key}, text)
                decoded_blobs[key] = memo
                used[id(memo[0])] = memo
                return memo[0]
            if "r" in node:
                return objects[node["r"]]
            if "e" in node:
                return _resolve_class(node["e"])(node["v"])
            if "y" in node:
                return base64.b64decode(node["y"])
            if "c" in node:
                cls = _resolve_class(node["c"])
                obj: Any = object.__new__(cls)
                if "i" in node:
                    objects[node["i"]] = obj
                stored = {f.name for f in _stored_fields(cls)}
                for f in dataclasses.fields(cls):
                    if f.name in stored and f.name in node["f"]:
                        value = dec(node["f"][f.name])
                    elif f.default is not dataclasses.MISSING:
                        value = f.default
                    elif f.default_factory is not dataclasses.MISSING:
                        value = f.default_factory()
                    else:
                        raise ValueError(f"stored {node['c']} lacks its field {f.name!r}")
                    object.__setattr__(obj, f.name, value)
                if hasattr(obj, "__post_load__"):
                    loaded.append(obj)
                return obj
            if "d" in node:
                return {k: dec(v) for k, v in node["d"].items()}
            if "k" in node:
                return {dec(k): dec(v) for k, v in node["k"]}
            if "o" in node:
                return OrderedDict((dec(k), dec(v)) for k, v in node["o"])
            if "n" in node:
                return _resolve_class(node["n"])(*(dec(v) for v in node["t"]))
            if "t" in node:
                return tuple(dec(v) for v in node["t"])
            if "s" in node:
                return {dec(v) for v in node["s"]}
            if "z" in node:
                return frozenset(dec(v) for v in node["z"])
            raise ValueError(f"unknown node in the stored catalog state: {node!r:.80}")

        root = dec(json.loads(document)["root"])
        for obj in reversed(loaded):  # inner objects first, the root last
            obj.__post_load__()
        self._memo = used
        return root
