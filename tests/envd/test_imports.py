"""envd runs from the tools layer, which holds only ENVD_REQUIREMENTS (and their dependencies)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from importlib import metadata

from agentenv.envd import ENVD_REQUIREMENTS


def _dist_closure(reqs: list[str]) -> set[str]:
    seen: set[str] = set()
    todo = [re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0] for r in reqs]
    while todo:
        name = todo.pop().lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for req in requires:
            if "extra ==" in req:
                continue
            todo.append(re.split(r"[<>=!~;\[ (]", req, maxsplit=1)[0])
    return seen


def test_envd_imports_only_its_declared_requirements():
    code = (
        "import sys, json; before = set(sys.modules);"
        "import agentenv.envd.server, agentenv.envd.__main__;"
        "print(json.dumps(sorted({m.split('.')[0] for m in set(sys.modules) - before})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    top_level = set(json.loads(out.stdout))
    allowed_dists = _dist_closure(ENVD_REQUIREMENTS)
    owners = metadata.packages_distributions()
    offenders = []
    for mod in top_level:
        if mod in sys.stdlib_module_names or mod.startswith("_") or mod in ("agentenv", "cython_runtime"):
            continue
        dists = {d.lower().replace("_", "-") for d in owners.get(mod, [])}
        if not dists & allowed_dists:
            offenders.append((mod, sorted(dists)))
    assert not offenders, f"envd imports modules outside ENVD_REQUIREMENTS: {offenders}"
    # and envd's own agentenv imports stay within constants + envd
    code = (
        "import sys; import agentenv.envd.server, agentenv.envd.__main__;"
        "print('\\n'.join(m for m in sys.modules if m.startswith('agentenv')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    for mod in out.stdout.split():
        assert mod in ("agentenv", "agentenv.constants") or mod.startswith("agentenv.envd"), mod
