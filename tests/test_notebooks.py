"""The Colab notebooks: committed without outputs, and each runs end to end in tiny mode.

Each notebook is executed in a python3 kernel with CBS_NOTEBOOK_TINY=1 (its own switch to
the configs' `:tiny` variants), one CPU device (no fake devices, as in a Colab CPU runtime)
and TMPDIR pointed at a temporary directory, where the notebooks put their sweep
directories. The five share one kernel, started once, and each starts from an empty
namespace (`%reset -f`), as after "Restart kernel" but without importing JAX again: five
kernel starts and import cells cost about 25 CPU-s of the suite. About half a minute per
notebook on 2 busy CPU cores.
"""

import pathlib
import re

import nbformat
import pytest
from conftest import SUBPROCESS_XLA_FLAGS
from nbclient import NotebookClient
from nbclient.util import ensure_async, run_sync

NOTEBOOK_DIR = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
IDS = [p.stem for p in NOTEBOOKS]
CELL_TIMEOUT_S = 300  # per cell; a whole notebook takes well under 2 minutes in tiny mode


def _code(nb) -> list[str]:
    return [c.source for c in nb.cells if c.cell_type == "code"]


def test_every_notebook_is_numbered_titled_and_linked_from_readme():
    readme = (NOTEBOOK_DIR.parent / "README.md").read_text()
    assert [p.stem[:3] for p in NOTEBOOKS] == ["01_", "02_", "03_", "04_", "05_"]
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        title = nb.cells[0].source.splitlines()[0]
        assert nb.cells[0].cell_type == "markdown" and title.startswith(f"# {path.stem[:2]} ·")
        assert f"](notebooks/{path.name})" in readme, f"README.md has no link to {path.name}"
        assert f"`{path.stem}`" in (NOTEBOOK_DIR / "README.md").read_text(), (
            f"notebooks/README.md does not list {path.name}")


def test_no_link_points_at_a_placeholder():
    for path in [NOTEBOOK_DIR.parent / "README.md", NOTEBOOK_DIR / "README.md", *NOTEBOOKS]:
        text = path.read_text()
        for placeholder in ("<owner>", "<user>", "YOUR_", "<your"):
            assert placeholder not in text, f"{path.name} holds the placeholder {placeholder}"


def test_setup_cell_installs_the_package_without_a_repository_url():
    """The first cell: cbs as the installed package (its presets from `cbs.configs`); in a
    checkout it imports cbs from the checkout's own folder and installs the checkout in
    development mode (for its dependencies) only when that import fails; elsewhere (Colab) it
    installs the distribution `cbs-jax` from the package index. Nothing is cloned, no
    repository URL is asked for, and no notebook imports the checkout's `experiments`."""
    for path in NOTEBOOKS:
        text = path.read_text()
        for needle in ("git clone", "REPO_URL", "github.com"):
            assert needle not in text, f"{path.name} holds {needle!r}"
        code = _code(nbformat.read(path, as_version=4))
        imports = [line for cell in code for line in cell.splitlines()
                   if re.match(r"\s*(from|import)\s+experiments\b", line)]
        assert imports == [], f"{path.name} imports experiments: {imports}"
        first = code[0]
        on_path = first.index("sys.path.insert(0, str(CHECKOUT))")
        fallback = first.index("except ImportError:")
        assert on_path < first.index("    import cbs") < fallback
        assert first.index('[*pip, "-e", str(CHECKOUT)]', fallback) > fallback
        assert first.index('[*pip, "cbs-jax", *accelerator]', fallback) > fallback
        assert "RESULTS_DIR = " in first


def test_setup_cell_installs_the_distribution_named_in_pyproject():
    pyproject = (NOTEBOOK_DIR.parent / "pyproject.toml").read_text()
    name = re.search(r'(?m)^name = "([^"]+)"', pyproject).group(1)
    for path in NOTEBOOKS:
        assert f'"{name}"' in _code(nbformat.read(path, as_version=4))[0], path.name


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert "widgets" not in nb.metadata
    for cell in nb.cells:
        assert "execution" not in cell.metadata, "run metadata: python notebooks/strip_outputs.py"
        if cell.cell_type == "code":
            assert cell.outputs == [], f"outputs in {path.name}: python notebooks/strip_outputs.py"
            assert cell.execution_count is None


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_setup_cell_and_public_api_only(path):
    nb = nbformat.read(path, as_version=4)
    code = _code(nb)
    first = code[0]
    for needle in ('"google.colab" in sys.modules', "CBS_NOTEBOOK_TINY", "jax.devices()"):
        assert needle in first, f"{path.name}: first code cell lacks {needle!r}"
    source = "\n".join(code)
    assert "from cbs" in source or "import cbs" in source
    # no underscore names of the library: attributes, imports or dict keys like "_fits"
    private = re.findall(r"\.\_[A-Za-z]\w*|import \_\w+|\[\"\_\w+\"\]", source)
    assert private == [], f"{path.name} uses private names {private}"


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    """A client holding one running python3 kernel (started on an empty notebook, in the
    notebooks' folder, with the tiny-mode environment), shut down after the module."""
    tmp = tmp_path_factory.mktemp("notebooks")
    client = NotebookClient(nbformat.v4.new_notebook(), timeout=CELL_TIMEOUT_S,
                            kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
    with pytest.MonkeyPatch.context() as env:  # what the kernel process inherits
        env.setenv("CBS_NOTEBOOK_TINY", "1")
        env.setenv("JAX_PLATFORMS", "cpu")
        # one CPU device (not the 8 fake ones of conftest), compiled at the same level
        env.setenv("XLA_FLAGS", SUBPROCESS_XLA_FLAGS)
        env.setenv("TMPDIR", str(tmp))
        client.execute(cleanup_kc=False)  # starts the kernel and keeps it running
    yield client

    async def shutdown():
        client.kc.stop_channels()
        await ensure_async(client.km.shutdown_kernel(now=True))

    run_sync(shutdown)()


@pytest.mark.xdist_group("notebooks")  # one worker runs them all, in the one kernel
@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_runs_in_tiny_mode(path, kernel):
    files_before = sorted(NOTEBOOK_DIR.rglob("*"))
    nb = nbformat.read(path, as_version=4)
    nb.cells.insert(0, nbformat.v4.new_code_cell("%reset -f"))  # an empty namespace
    kernel.nb = nb
    kernel.execute(cleanup_kc=False)  # raises CellExecutionError, with the traceback, if a
    #                                   cell fails
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert "tiny mode" in "".join(o.get("text", "") for o in outputs)
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 2, f"{path.name} showed {len(images)} figures"
    assert sorted(NOTEBOOK_DIR.rglob("*")) == files_before  # wrote nothing beside itself
