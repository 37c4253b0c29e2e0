"""The engine's modules keep to their boundaries (read statically, no import): none reads another's private
attributes, and the KV manager's state is reached only by the KV package and the scheduler that owns it; the rest of
the engine asks through the scheduler's narrow queries (`Scheduler.prefix_cache`, `Scheduler.stats`)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ROOT / "engine"

# Private reads that are not another module's internals, each with why.
ALLOWED_PRIVATE = {
    ("engine/worker/grammar_compile.py", "os._exit"),  # a forked child ends without the parent's atexit handlers
    ("engine/parallel/rank.py", "os._exit"),
    ("engine/core/process.py", "os._exit"),
    ("engine/core/processes.py", "os._exit"),
    ("engine/parallel/state.py", "dist.distributed_c10d._abort_process_group"),  # torch has no public abort
    # a tokenizer's copy gets a Rust tokenizer of its own: transformers reads it as `_tokenizer`, with no public setter
    ("engine/text/tokenizer_load.py", "copied._tokenizer"),
    # expandable segments after CUDA is initialised (the env variable is read once, at the first allocation)
    ("engine/worker/model_runner.py", "torch.cuda.memory._set_allocator_settings"),
}
# The running columns hold a running sequence's counters in place of its fields (engine/sched/step_state.py): the
# two modules are one object split for speed.
ALLOWED_PRIVATE_RECEIVERS = {("engine/sched/step_state.py", "seq")}
KV_INTERNALS = {"seqs", "tiers", "states", "queue", "by_hash", "roots", "free_block_ids", "events"}
KV_OWNERS = ("engine/kv/", "engine/sched/")  # the KV package, and the scheduler (engine/sched/scheduler.py and its parts)


def _modules():
    for path in sorted(ENGINE.rglob("*.py")):
        yield path.relative_to(ROOT).as_posix(), ast.parse(path.read_text(encoding="utf-8"))


def _classes_of(tree: ast.Module) -> set[str]:
    return {node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}


def _own_privates(tree: ast.Module) -> set[str]:
    """The private attributes the module's own classes define (methods, class fields, ``self._x = ...``): reading
    them on any instance is the module's own business."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    names.add(item.target.id)
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name)
              and node.value.id == "self"):
            names.add(node.attr)
    return {name for name in names if name.startswith("_")}


def private_reads(name: str, tree: ast.Module) -> list[str]:
    """Reads of ``_private`` attributes of anything but ``self``, ``cls`` or the module's own classes and instances."""
    own, privates, found = _classes_of(tree), _own_privates(tree), []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
            continue
        if node.attr in privates:
            continue
        receiver = node.value
        if isinstance(receiver, ast.Name) and (receiver.id in ("self", "cls") or receiver.id in own
                                               or (name, receiver.id) in ALLOWED_PRIVATE_RECEIVERS):
            continue
        if (name, ast.unparse(node)) not in ALLOWED_PRIVATE:
            found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    return found


def kv_reach_ins(name: str, tree: ast.Module) -> list[str]:
    """``something.kv`` (the scheduler's manager) and ``kv.<the manager's state>`` outside the KV package and the
    scheduler."""
    if name.startswith(KV_OWNERS):
        return []
    return [f"{name}:{node.lineno}: {ast.unparse(node)}" for node in ast.walk(tree)
            if isinstance(node, ast.Attribute)
            and ((node.attr == "kv" and not (isinstance(node.value, ast.Name) and node.value.id == "self"))
                 or (node.attr in KV_INTERNALS and isinstance(node.value, ast.Name) and node.value.id == "kv"))]


def test_no_engine_module_reads_another_ones_private_attributes() -> None:
    found = [f for name, tree in _modules() for f in private_reads(name, tree)]
    assert not found, "private attributes read across modules:\n" + "\n".join(found)


def test_only_the_kv_package_and_the_scheduler_reach_the_kv_manager() -> None:
    found = [f for name, tree in _modules() for f in kv_reach_ins(name, tree)]
    assert not found, "the KV manager reached from outside its owners:\n" + "\n".join(found)


def test_the_checks_flag_what_they_exist_for() -> None:
    tree = ast.parse("def f(engine, seq, kv):\n    engine.scheduler.kv.seqs.clear()\n    kv.tiers.host = None\n"
                     "    return seq._tokens\n")
    assert private_reads("engine/core/loop.py", tree) == ["engine/core/loop.py:4: seq._tokens"]
    assert sorted(f.split(": ")[1] for f in kv_reach_ins("engine/core/loop.py", tree)) == [
        "engine.scheduler.kv", "kv.tiers"]
    assert kv_reach_ins("engine/sched/scheduler.py", tree) == []
    assert sum(1 for _ in _modules()) > 80
