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
    ("MaxText.input_pipeline", "MaxText.input_pipeline.teacher_top_k"): "read only when distill_top_k_path is set",
    ("MaxText.input_pipeline", "MaxText.paths.storage"): "the package's import stays free of etils for the readers",
    ("MaxText.input_pipeline", "MaxText.errors"): "imported with the readers it serves",
    ("MaxText.input_pipeline.prepare_data", "MaxText.input_pipeline.tfds_builder"): "tensorflow-datasets' builder, "
    "only for the tfds preparation",
    ("MaxText.decode", "MaxText.input_pipeline.chat"): "the chat template's tokenizer stack, only for chat prompts",
    **{("MaxText.input_pipeline", m): "the package's import stays free of JAX: the server's HTTP front-end "
       "processes (inference/serve_frontend.py) read the tokenizer through it"
       for m in ("MaxText.platform.sharding", "MaxText.input_pipeline.synthetic", "MaxText.input_pipeline.packing")},
    ("MaxText.inference.serve_app", "MaxText.inference.serve_routes"): "FastAPI loads only when the server starts",
    ("MaxText.inference.serve_app", "MaxText.inference.lora_routes"): "FastAPI loads only when the server "
    "starts with adapters",
    ("MaxText.training.metrics", "MaxText.layers.moe"): "flax and the layers load only for a MoE model's FLOPs",
    ("MaxText.plan", "MaxText.training.run_assembly"): "JAX's backend must start after the planner sets the XLA flags",
    ("MaxText.plan", "MaxText.train_compile"): "JAX's backend must start after the planner sets the XLA flags",
    ("MaxText.plan", "MaxText.aot.hlo_cycles"): "JAX's backend must start after the planner sets the XLA flags",
    ("MaxText.plan", "MaxText.aot.memory_report"): "JAX's backend must start after the planner sets the XLA flags",
    ("MaxText.plan", "MaxText.layers.attention"): "flax and the layers load only for the kernel choice",
    ("MaxText.aot.plan_model", "MaxText.models"): "flax and the model load only for the planner's parameter count",
    ("MaxText.aot.plan_remat", "MaxText.families"): "flax: the family's layer is read only when a plan prices it",
    ("MaxText.aot.plan_remat", "MaxText.layers.decoders"): "flax: the shared layer is read only when a plan prices it",
    ("MaxText.aot.plan_remat", "MaxText.layers.moe"): "flax: the expert capacity rule loads only for MoE models",
    ("MaxText.training.metrics", "MaxText.layers.layer_shapes"): "flax: each layer's own shape loads only for a "
    "stack of differing layers (Gemma 4)",
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


# The packages (and top-level modules) from the bottom up: a module imports only its own rank and the
# ranks below it. The model's parts rise from the generic layers through the families (each owning its
# layers, vision tower and tensor table) to the assembled model; training runs a model, and the
# converters, the decode engine and reinforcement learning use training's assembly.
FOLDER_ORDER: tuple[tuple[str, ...], ...] = (
    ("MaxText", "MaxText.errors", "MaxText.json_text"),
    ("MaxText.paths", "MaxText.platform"),
    ("MaxText.configuration",),
    ("MaxText.run_dir",),
    ("MaxText.startup",),
    ("MaxText.layers",),
    ("MaxText.families",),
    ("MaxText.models",),
    ("MaxText.input_pipeline",),  # reads images as the model's family cuts them (Family.image_format)
    ("MaxText.training",),
    ("MaxText.aot",),
    ("MaxText.convert",),
    ("MaxText.inference",),
    ("MaxText.rl",),
    # entry points (the converters and prepare_data.py live inside their packages)
    ("MaxText.train_compile", "MaxText.train", "MaxText.plan", "MaxText.decode", "MaxText.serve",
     "MaxText.generate_param_only_checkpoint", "MaxText.generate_teacher_top_k", "MaxText.logit_checker",
     "MaxText.train_tokenizer",
     "MaxText.multihost_runner", "MaxText.multihost_job", "MaxText.elastic"),
)
# (importer, imported) -> why this import climbs back up the order.
CLIMBS_ALLOWED: dict[tuple[str, str], str] = {}


def _rank(module: str) -> int | None:
  """The rank of the longest listed package or module `module` belongs to."""
  best, best_len = None, -1
  for rank, names in enumerate(FOLDER_ORDER):
    for name in names:
      if (module == name or module.startswith(name + ".")) and len(name) > best_len:
        best, best_len = rank, len(name)
  return best


def climbing_imports(graph: import_graph.Graph) -> list[str]:
  """Every import (at file grain) of a module ranked above its importer in FOLDER_ORDER."""
  return [f"{imp.importer}:{imp.line} imports {imp.imported}" for imp in sorted(
              graph.imports, key=lambda i: (i.importer, i.line, i.imported))
          if (_rank(imp.imported) or 0) > (_rank(imp.importer) or 0)
          and (imp.importer, imp.imported) not in CLIMBS_ALLOWED]


def test_packages_import_down_the_folder_order() -> None:
  graph = import_graph.build()
  unranked = sorted(m for m in graph.modules if _rank(m) is None or (_rank(m) == 0 and m not in FOLDER_ORDER[0]))
  assert not unranked, f"modules outside FOLDER_ORDER (give the package or entry point its rank): {unranked}"
  climbs = climbing_imports(graph)
  assert not climbs, "imports that climb back up FOLDER_ORDER (move the code down, or list the import in " \
                     "CLIMBS_ALLOWED with why): " + "; ".join(climbs)
