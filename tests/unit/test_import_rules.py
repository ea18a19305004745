"""torch.distributed is imported only by comm/, per the design; also by testing/ (the test spawner starts
process groups) and launcher/ (it runs torch.distributed.run's elastic agent and never joins a group)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "lightspeed"
ALLOWED = {"comm", "testing", "launcher"}


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def test_torch_distributed_only_in_comm():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.relative_to(PACKAGE).parts[0] in ALLOWED:
            continue
        if any(name == "torch.distributed" or name.startswith("torch.distributed.") for name in _imports(path)):
            offenders.append(str(path.relative_to(PACKAGE)))
    assert not offenders, f"torch.distributed imported outside comm/: {offenders}"
