"""The MaxText package imports as a DAG: no import cycle, and no import of a project module inside
a function except the ones listed below with their reason (a lazy import that hides a cycle is
never a reason). The graph comes from the source (tests/import_graph.py)."""

from __future__ import annotations

import import_graph

# (importer, imported) -> why the import waits until the function runs.
FUNCTION_LEVEL_ALLOWED: dict[tuple[str, str], str] = {
    **{("MaxText.input_pipeline", f"MaxText.input_pipeline.{m}"): "a data source's readers load its optional "
       "libraries (tensorflow-datasets, datasets, grain, tokenizers) only when that source is configured"
       for m in ("files", "tokenizer", "chat", "image_sft", "tfds", "hf", "grain", "pipeline", "preference",
                 "mixture", "streaming")},
    ("MaxText.input_pipeline", "MaxText.paths.storage"): "the package's import stays free of etils for the readers",
    ("MaxText.input_pipeline", "MaxText.errors"): "imported with the readers it serves",
    ("MaxText.input_pipeline.hf", "MaxText.input_pipeline.json_records"): "read only after a failed JSON parse",
    ("MaxText.input_pipeline.prepare_data", "MaxText.input_pipeline.tfds_builder"): "tensorflow-datasets' builder, "
    "only for the tfds preparation",
    ("MaxText.decode", "MaxText.input_pipeline.chat"): "the chat template's tokenizer stack, only for chat prompts",
    ("MaxText.serve", "MaxText.input_pipeline.tokenizer"): "the tokenizer libraries load after the CLI is parsed",
    ("MaxText.serve", "MaxText.errors"): "imported with the chat template it checks",
    ("MaxText.serve", "MaxText.input_pipeline.chat"): "the chat template's tokenizer stack, only when serving chat",
    ("MaxText.serve", "MaxText.inference.serve_routes"): "FastAPI loads only when the server starts",
    ("MaxText.layers.decoders", "MaxText.families"): "the family registry lists and imports every family module "
    "(and the converter tables), which a layer class lookup needs only when a model is built",
    ("MaxText.training.metrics", "MaxText.layers.moe"): "flax and the layers load only for a MoE model's FLOPs",
    ("MaxText.plan", "MaxText.training.run_assembly"): "JAX's backend must start after the planner sets the XLA flags",
    ("MaxText.plan", "MaxText.train_compile"): "JAX's backend must start after the planner sets the XLA flags",
    ("MaxText.plan", "MaxText.aot.hlo_cycles"): "JAX's backend must start after the planner sets the XLA flags",
    ("MaxText.plan", "MaxText.aot.memory_report"): "JAX's backend must start after the planner sets the XLA flags",
    ("MaxText.plan", "MaxText.layers.attention"): "flax and the layers load only for the kernel choice",
    ("MaxText.aot.plan_model", "MaxText.layers.models"): "flax and the model load only for the planner's parameter count",
}


def test_no_import_cycle() -> None:
  cycles = import_graph.cycles(import_graph.build().edges)
  assert not cycles, "import cycles: " + "; ".join(" -> ".join(cycle) for cycle in cycles)


def test_function_level_imports_are_listed_with_a_reason() -> None:
  found = {(imp.importer, imp.imported): imp for imp in import_graph.build().function_level()}
  unlisted = [f"{imp.importer}:{imp.line} imports {imp.imported}" for key, imp in sorted(found.items())
              if key not in FUNCTION_LEVEL_ALLOWED]
  assert not unlisted, ("imports of project modules inside functions (import at the top, or list it in "
                        "FUNCTION_LEVEL_ALLOWED with why it must wait; never to hide a cycle): " + "; ".join(unlisted))
  stale = sorted(set(FUNCTION_LEVEL_ALLOWED) - set(found))
  assert not stale, f"FUNCTION_LEVEL_ALLOWED lists imports that no longer exist: {stale}"


def test_graph_reads_relative_and_submodule_imports(tmp_path) -> None:
  package = tmp_path / "Pkg"
  (package / "sub").mkdir(parents=True)
  (package / "__init__.py").write_text("")
  (package / "a.py").write_text("from Pkg.sub import b\n")
  (package / "sub" / "__init__.py").write_text("")
  (package / "sub" / "b.py").write_text("from . import c\nfrom typing import TYPE_CHECKING\n"
                                        "if TYPE_CHECKING:\n  from Pkg import a\n")
  (package / "sub" / "c.py").write_text("def f():\n  from ..a import x\n")
  graph = import_graph.build(package)
  assert graph.edges["Pkg.a"] == {"Pkg.sub.b"} and graph.edges["Pkg.sub.b"] == {"Pkg.sub.c"}
  assert [(i.importer, i.imported) for i in graph.function_level()] == [("Pkg.sub.c", "Pkg.a")]
  assert import_graph.cycles(graph.edges) == [["Pkg.a", "Pkg.sub.b", "Pkg.sub.c", "Pkg.a"]]
  assert import_graph.levels(graph.edges) == 1  # the cycle counts as one module
