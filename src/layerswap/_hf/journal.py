"""One way to change transformers state and put it back: a journal of what was there before.

Every change layerswap makes to an object it does not own (a wrapped function, a class attribute, a registry
entry, a dict's items) goes through a Journal, which remembers the value it replaces the first time it touches a
place, and `undo` puts every place back, in reverse order, exactly: an attribute or key that was absent is removed
again. A place changed twice is remembered once, so undo restores the original, not the intermediate value.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping, MutableSet
from typing import Any

_ABSENT = object()


class Journal:
    def __init__(self) -> None:
        # One restore function per place, in the order places were first touched.
        self._entries: list[Callable[[], None]] = []
        self._places: set[tuple[int, Any]] = set()

    def __bool__(self) -> bool:
        return bool(self._entries)

    def _first_touch(self, owner: Any, key: Any) -> bool:
        place = (id(owner), key)
        if place in self._places:
            return False
        self._places.add(place)
        return True

    def set_attribute(self, owner: Any, name: str, value: Any) -> None:
        """`setattr(owner, name, value)`; a class's own `__dict__` entry is what is remembered (an inherited
        attribute is absent there, and undo deletes the override)."""
        if self._first_touch(owner, ("attr", name)):
            found = vars(owner).get(name, _ABSENT) if hasattr(owner, "__dict__") else getattr(owner, name)
            self._entries.append(lambda: _put_attribute(owner, name, found))
        setattr(owner, name, value)

    def set_item(self, mapping: MutableMapping, key: Any, value: Any) -> None:
        self.remember_item(mapping, key)
        mapping[key] = value

    def pop_item(self, mapping: MutableMapping, key: Any) -> None:
        self.remember_item(mapping, key)
        mapping.pop(key, None)

    def remember_item(self, mapping: MutableMapping, key: Any) -> None:
        if self._first_touch(mapping, ("item", key)):
            found = mapping.get(key, _ABSENT)
            self._entries.append(lambda: _put_item(mapping, key, found))

    def add_to_set(self, members: MutableSet, value: Any) -> None:
        if self._first_touch(members, ("member", value)):
            present = value in members
            self._entries.append(lambda: members.add(value) if present else members.discard(value))
        members.add(value)

    def remember_contents(self, mapping: dict) -> bool:
        """Remember every item of `mapping` (before something outside layerswap rewrites it in place); undo puts
        back exactly those items. False when it was remembered already."""
        if not self._first_touch(mapping, "contents"):
            return False
        items = dict(mapping)

        def restore() -> None:
            mapping.clear()
            mapping.update(items)

        self._entries.append(restore)
        return True

    def remember_attribute(self, owner: Any, name: str) -> None:
        """Remember `owner.name` (an instance attribute something else is about to rewrite)."""
        if self._first_touch(owner, ("attr", name)):
            found = getattr(owner, name)
            self._entries.append(lambda: setattr(owner, name, found))

    def undo(self) -> None:
        while self._entries:
            self._entries.pop()()
        self._places.clear()


def _put_attribute(owner: Any, name: str, value: Any) -> None:
    if value is _ABSENT:
        if name in vars(owner):
            delattr(owner, name)
    else:
        setattr(owner, name, value)


def _put_item(mapping: MutableMapping, key: Any, value: Any) -> None:
    if value is _ABSENT:
        mapping.pop(key, None)
    else:
        mapping[key] = value
