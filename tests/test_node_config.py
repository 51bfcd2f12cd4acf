"""An engine node's start-up values (engine/node/config.py): refused when the node starts, not at its first
model load or its first SIGTERM."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.node.config import ModelSpec, NodeConfig
from engine.node.serve import bind_address

ROOT = Path(__file__).resolve().parent.parent
MODELS = [ModelSpec("model.gguf", "m")]    # NodeConfig does not open the file


@pytest.mark.parametrize("kwargs, words", [
    (dict(block_size=3), "block_size must be a power of two, got 3"),
    (dict(block_size=0), "block_size must be a power of two, got 0"),
    (dict(max_model_len=-5), "max_model_len must be >= 1, got -5"),
    (dict(max_model_len=0), "max_model_len must be >= 1, got 0"),
    (dict(load_wait_s=-1), "load_wait_s must be a finite number >= 0, got -1"),
    (dict(load_wait_s=float("inf")), "load_wait_s must be a finite number >= 0, got inf"),
    (dict(drain_grace_s=float("inf")), "drain_grace_s must be a finite number >= 0, got inf"),
    (dict(drain_grace_s=float("nan")), "drain_grace_s must be a finite number >= 0, got nan"),
    (dict(drain_grace_s=-1.0), "drain_grace_s must be a finite number >= 0"),
    (dict(org_waiting_share=0.0), r"org_waiting_share must be in \(0, 1\], got 0.0"),
    (dict(org_waiting_share=float("nan")), r"org_waiting_share must be in \(0, 1\], got nan"),
])
def test_bad_start_up_values_are_refused(kwargs, words):
    with pytest.raises(ValueError, match=words):
        NodeConfig(models=MODELS, **kwargs)


def test_good_values_pass():
    config = NodeConfig(models=MODELS, block_size=32, max_model_len=2048, load_wait_s=0, drain_grace_s=0)
    assert config.engine_config(MODELS[0], None).block_size == 32


@pytest.mark.parametrize("host, bind", [("[::1]", "[::1]:8001"), ("::1", "[::1]:8001"),
                                        ("127.0.0.1", "127.0.0.1:8001"), ("localhost", "localhost:8001")])
def test_an_ipv6_host_is_bracketed_once(host, bind):
    config = NodeConfig(models=MODELS, host=host)
    assert config.host == host.strip("[]") and bind_address(config) == bind


@pytest.mark.parametrize("args, env, words", [
    (["--block-size", "3"], {}, "error: block_size must be a power of two, got 3"),
    (["--drain-grace-s", "inf"], {}, "error: drain_grace_s must be a finite number >= 0, got inf"),
    (["--org-waiting-share", "1.5"], {}, "error: org_waiting_share must be in (0, 1], got 1.5"),
    ([], {"NODE_DRAIN_GRACE_S": "inf"}, "error: drain_grace_s must be a finite number >= 0, got inf"),
])
def test_the_node_refuses_to_start_with_one_error_line(tmp_path, args, env, words):
    model = tmp_path / "model.gguf"
    model.write_bytes(b"")     # never read: the configuration is refused first
    out = subprocess.run([sys.executable, "-m", "engine", "serve", "--models", str(model), *args],
                         cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and words in out.stderr and "Traceback" not in out.stderr
