"""The structure the architecture promises, read from the code's AST: no import circle in
``comms/`` among files or folders, at most 6 floors of folders, adapters (``ddp``, ``fsdp``)
never importing each other, and the size limits (function 60 lines, module 400, class 15
methods) in ``comms/`` and ``compressors/``."""

import ast
import collections
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _modules(top: str) -> dict:
    out = {}
    for dp, _, fn in os.walk(os.path.join(ROOT, top)):
        for f in fn:
            if f.endswith(".py"):
                p = os.path.join(dp, f)
                rel = os.path.relpath(p, ROOT)[:-3].replace(os.sep, ".")
                out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = (p, f == "__init__.py")
    return out


def _imports(mods: dict) -> dict:
    graph = {}
    for mod, (path, pkg) in mods.items():
        base = mod if pkg else mod.rsplit(".", 1)[0]
        deps = set()
        for n in ast.walk(ast.parse(open(path).read())):
            if isinstance(n, ast.ImportFrom):
                t = ".".join(base.split(".")[: len(base.split(".")) - n.level + 1] + [n.module or ""]).strip(".") \
                    if n.level else (n.module or "")
                for a in n.names:
                    deps.add(f"{t}.{a.name}" if f"{t}.{a.name}" in mods else t)
            elif isinstance(n, ast.Import):
                deps |= {a.name for a in n.names}
        graph[mod] = {d for d in deps if d in mods and d != mod}
    return graph


def _circles(graph: dict) -> list:
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def _folders(graph: dict) -> dict:
    rooms = collections.defaultdict(set)
    for m, deps in graph.items():
        room = ".".join(m.split(".")[:2])
        rooms[room]
        rooms[room] |= {".".join(d.split(".")[:2]) for d in deps} - {room}
    return rooms


def test_comms_has_no_import_circle_and_at_most_six_floors():
    graph = _imports(_modules("comms"))
    assert _circles(graph) == []
    rooms = _folders(graph)
    assert _circles(rooms) == []
    floors = {}

    def floor(r):
        if r not in floors:
            floors[r] = 1 + max((floor(d) for d in rooms[r]), default=0)
        return floors[r]

    assert max(floor(r) for r in rooms) <= 6, {r: floor(r) for r in rooms}
    assert "comms.fsdp" not in rooms["comms.ddp"] and "comms.ddp" not in rooms["comms.fsdp"]
    assert not rooms["comms.core"] & {"comms.ddp", "comms.fsdp", "comms.integrations", "comms.outer"}


def test_no_function_class_or_module_over_the_limits():
    over = []
    for top in ("comms", "compressors"):
        for path, _ in _modules(top).values():
            src = open(path).read()
            if src.count("\n") > 400:
                over.append(f"{path}: {src.count(chr(10))} lines")
            for n in ast.walk(ast.parse(src)):
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 60:
                    over.append(f"{path}:{n.lineno} {n.name}: {n.end_lineno - n.lineno + 1} lines")
                if isinstance(n, ast.ClassDef):
                    k = sum(isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) for b in n.body)
                    if k > 15:
                        over.append(f"{path}:{n.lineno} {n.name}: {k} methods")
    assert over == []
