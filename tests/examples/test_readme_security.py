"""The cluster guide's (docs/cluster.md) security advice: the fleet's Ray head is bound to the cluster network, token
authentication stays on, and the reader learns who can run code on the head and that checkpoints are trusted."""

from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
README = EXAMPLES.parent / "docs" / "cluster.md"


def test_the_ray_head_is_not_bound_to_every_interface_and_token_auth_stays_on():
    text = README.read_text()
    script = (EXAMPLES / "lib" / "ray_cluster.sh").read_text()
    heads = [line for line in (text + script).splitlines() if "start --head" in line]
    assert len(heads) >= 2 and all("0.0.0.0" not in line and "--dashboard-host" in line for line in heads)
    assert "export RAY_AUTH_MODE=token" in script
    security = text.split("## 6. Security", 1)[1]
    for needed in ("RAY_AUTH_MODE=token", "run arbitrary code", "10001", "8265", "6379", "--no-dump-rollouts"):
        assert needed in security, needed
    assert "trusted input" in text.split("## 5. Checkpoints", 1)[1]
