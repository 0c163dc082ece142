#!/usr/bin/env python3
"""The house rules a newcomer relies on, checked (run by scripts/test.sh):

1. No import circle between top-level modules of `src/` (`app`, `server`, `service`, ...): a
   module that uses another is never used back by it, directly or through others.
2. No import circle between sibling files of one directory (`service/headers.rs` and
   `service/respond.rs`, say).
3. No file under `src/` longer than 600 lines, its unit tests aside (a trailing
   `#[cfg(test)] mod tests { .. }` and files that are themselves tests do not count).
4. No function under `src/` longer than 80 lines, from its `fn` line to its closing brace
   (issue 37: a function is read whole or not at all).

Exits 1 and names every circle and every long file it finds.
"""

import pathlib
import re
import sys

SRC = pathlib.Path(__file__).resolve().parent.parent / "src"
MAX_LINES = 600
MAX_FN_LINES = 80
FN_START = re.compile(r"^(\s*)(?:pub(?:\([^)]*\))?\s+)?(?:const\s+)?(?:async\s+)?fn\s+(\w+)")

# `crate::a::b`, `super::x`, and `use` groups of them.
CRATE_PATH = re.compile(r"\bcrate::([a-z_][a-z0-9_]*)(?:::([a-z_][a-z0-9_]*))?")
SUPER_PATH = re.compile(r"\bsuper::([a-z_][a-z0-9_]*)")
USE_CRATE_GROUP = re.compile(r"\buse\s+crate::\{([^;]*)\};", re.S)
USE_CRATE_SUB_GROUP = re.compile(r"\buse\s+crate::([a-z_][a-z0-9_]*)::\{([^;]*)\};", re.S)
USE_SUPER_GROUP = re.compile(r"\buse\s+super::\{([^;]*)\};", re.S)
TEST_MOD = re.compile(r"^#\[cfg\(test\)\]\s*\n\s*mod tests\s*\{", re.M)


def without_comments(text: str) -> str:
    text = re.sub(r"//[^\n]*", "", text)
    return re.sub(r"/\*.*?\*/", "", text, flags=re.S)


def non_test_part(text: str) -> str:
    """The file without its trailing unit-test module."""
    m = TEST_MOD.search(text)
    return text[: m.start()] if m else text


def is_test_file(path: pathlib.Path) -> bool:
    rel = path.relative_to(SRC)
    return path.name == "tests.rs" or "tests" in rel.parts[:-1]


def top_module(path: pathlib.Path) -> str:
    rel = path.relative_to(SRC)
    return rel.parts[0].removesuffix(".rs")


def sibling_name(path: pathlib.Path) -> str:
    return path.stem


def module_dir(path: pathlib.Path) -> pathlib.Path:
    """The directory whose module `super::` in this file names: a `mod.rs` (or a crate root
    file) is its directory's module, so its `super` is one level up."""
    if path.name == "mod.rs":
        return path.parent.parent
    return path.parent


def first_names(group: str) -> list[str]:
    names = []
    for part in group.split(","):
        part = part.strip()
        if not part:
            continue
        names.append(re.split(r"::|\s", part)[0].strip("{} "))
    return names


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every elementary cycle's node set, found as strongly connected components of > 1 node
    (and self-loops are ignored: a module using itself is no circle)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    counter = [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w == v:
                continue
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def circles(graph: dict[str, set[str]], seen: dict[tuple[str, str], str], what: str) -> list[str]:
    """One problem per circle of `graph`, naming each edge and the file that makes it."""
    out = []
    for cycle in find_cycles(graph):
        where = [f"{a} -> {b} ({seen[(a, b)]})" for a in cycle for b in cycle if (a, b) in seen]
        out.append(f"import circle between {what}: " + " / ".join(cycle) + "\n    "
                   + "\n    ".join(where))
    return out


def main() -> int:
    files = sorted(p for p in SRC.rglob("*.rs"))
    problems = []

    # 1. Top-level modules.
    tops = {top_module(p) for p in files}
    graph: dict[str, set[str]] = {t: set() for t in tops}
    edges_seen: dict[tuple[str, str], str] = {}
    for p in files:
        if is_test_file(p) or p.name in ("main.rs", "lib.rs"):
            continue
        text = without_comments(non_test_part(p.read_text()))
        me = top_module(p)
        used = {m.group(1) for m in CRATE_PATH.finditer(text)}
        for g in USE_CRATE_GROUP.finditer(text):
            used.update(first_names(g.group(1)))
        for dep in used:
            if dep in tops and dep != me:
                graph[me].add(dep)
                edges_seen.setdefault((me, dep), str(p.relative_to(SRC)))
    problems += circles(graph, edges_seen, "top-level modules")

    # 2. Sibling files of one directory.
    by_dir: dict[pathlib.Path, list[pathlib.Path]] = {}
    for p in files:
        by_dir.setdefault(p.parent, []).append(p)
    for d, siblings in sorted(by_dir.items()):
        names = {sibling_name(p) for p in siblings if p.name != "mod.rs"}
        # Directories that are modules: their `name/mod.rs` counts as the sibling `name`.
        for sub in d.iterdir():
            if sub.is_dir() and (sub / "mod.rs").exists():
                names.add(sub.name)
        graph = {n: set() for n in names}
        seen: dict[tuple[str, str], str] = {}
        members = [p for p in siblings if p.name != "mod.rs"]
        members += [sub / "mod.rs" for sub in d.iterdir()
                    if sub.is_dir() and (sub / "mod.rs").exists()]
        for p in members:
            if is_test_file(p):
                continue
            me = p.parent.name if p.name == "mod.rs" else p.stem
            text = without_comments(non_test_part(p.read_text()))
            used = set()
            if module_dir(p) == d:
                used |= {m.group(1) for m in SUPER_PATH.finditer(text)}
                for g in USE_SUPER_GROUP.finditer(text):
                    used.update(first_names(g.group(1)))
            # crate::<path to d>::<sibling>
            rel = d.relative_to(SRC).parts
            if rel:
                prefix = "crate::" + "::".join(rel) + "::"
                used |= set(re.findall(re.escape(prefix) + r"([a-z_][a-z0-9_]*)", text))
                if len(rel) == 1:
                    for g in USE_CRATE_SUB_GROUP.finditer(text):
                        if g.group(1) == rel[0]:
                            used.update(first_names(g.group(2)))
            for dep in used:
                if dep in names and dep != me:
                    graph[me].add(dep)
                    seen.setdefault((me, dep), str(p.relative_to(SRC)))
        problems += circles(graph, seen, f"files of src/{d.relative_to(SRC)}")

    # 3. Long files (Rust and the Lua scripts alike).
    for p in sorted(list(SRC.rglob("*.rs")) + list(SRC.rglob("*.lua"))):
        if is_test_file(p):
            continue
        n = non_test_part(p.read_text()).count("\n")
        if n > MAX_LINES:
            problems.append(f"src/{p.relative_to(SRC)}: {n} lines (at most {MAX_LINES}, "
                            "unit tests aside)")

    # 4. Long functions: from a `fn` line to the first line that is its indentation and `}`.
    for p in sorted(SRC.rglob("*.rs")):
        lines = p.read_text().split("\n")
        for i, line in enumerate(lines):
            m = FN_START.match(line)
            if not m or line.rstrip().endswith(";"):
                continue
            close = m.group(1) + "}"
            end = next((j for j in range(i + 1, len(lines)) if lines[j] == close), None)
            if end is not None and end - i + 1 > MAX_FN_LINES:
                problems.append(f"src/{p.relative_to(SRC)}:{i + 1}: fn {m.group(2)} is "
                                f"{end - i + 1} lines (at most {MAX_FN_LINES})")

    for problem in problems:
        print(problem)
    if problems:
        print(f"{len(problems)} problem(s): see scripts/check_structure.py for the rules")
        return 1
    print("structure: no import circle, no file over "
          f"{MAX_LINES} lines, no function over {MAX_FN_LINES} ({len(files)} Rust files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
