"""The backend is found by name in a fresh process that never imports the package."""
import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    assert "dynamo_sizebackend" not in sys.modules
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    compiled = torch.compile(model, backend="sizebackend", dynamic=True,
                             options="{'compile_sizes': [4], 'compiler': 'eager'}")
    with torch.no_grad():
        for n in (4, 3):
            x = torch.randn(n, 8)
            torch.testing.assert_close(compiled(x), model(x))
    import dynamo_sizebackend as sb  # only now, to read the counters
    print(json.dumps(sb.stats().to_dict()))
    """
)


def test_backend_found_by_name_in_fresh_process():
    env = dict(os.environ)
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    stats = json.loads(result.stdout.strip().splitlines()[-1])
    # No attention: one piece, compiled for the general shape and for size 4.
    assert stats["graphs"] == 1 and stats["pieces"] == 1
    assert stats["compiles"] == {"dynamic": 1, "4": 1}
    assert stats["calls"] == {"4": 1, "dynamic": 1}


def test_entry_point_is_declared_once():
    from importlib.metadata import entry_points

    eps = [ep for ep in entry_points(group="torch_dynamo_backends") if ep.name == "sizebackend"]
    assert len(eps) == 1 and eps[0].value == "dynamo_sizebackend.backend:sizebackend"
    import torch._dynamo

    assert "sizebackend" in torch._dynamo.list_backends()
