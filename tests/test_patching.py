"""AttrPatch puts back exactly what was there: a module's object, a class's own attribute, and
nothing on an instance whose method came from its class."""

from __future__ import annotations

import types

from trainprobe.engine.patching import AttrPatch


class Base:
    def hello(self) -> str:
        return "base"


class Child(Base):
    pass


def test_instance_method_patch_is_deleted_again() -> None:
    obj, other = Child(), Child()
    patch = AttrPatch()
    patch.replace(obj, "hello", lambda: "wrapped")
    assert obj.hello() == "wrapped" and other.hello() == "base"
    patch.restore()
    assert "hello" not in vars(obj)
    assert obj.hello() == "base"


def test_instance_attribute_gets_its_value_back() -> None:
    obj = Child()
    obj.hello = lambda: "own"  # type: ignore[method-assign]
    own = obj.hello
    patch = AttrPatch()
    patch.replace(obj, "hello", lambda: "wrapped")
    patch.restore()
    assert obj.hello is own


def test_class_and_module_attributes_restored() -> None:
    module = types.ModuleType("m")
    module.f = len  # type: ignore[attr-defined]
    patch = AttrPatch()
    patch.replace(Child, "hello", lambda self: "wrapped")
    patch.replace(module, "f", abs)
    assert Child().hello() == "wrapped" and module.f is abs  # type: ignore[attr-defined]
    patch.restore()
    assert "hello" not in vars(Child) and Child().hello() == "base"
    assert module.f is len  # type: ignore[attr-defined]
