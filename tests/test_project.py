"""The README's two commands are the project's entry points; CI must run the second one verbatim."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    readme = ROOT.joinpath("README.md").read_text().splitlines()
    assert readme[0] == "```bash" and readme[3] == "```"
    test_cmd = readme[2]
    assert "pytest" in test_cmd and "torch==2.13.0" in test_cmd
    ci = ROOT.joinpath(".ci/run").read_text().splitlines()
    assert test_cmd in ci
