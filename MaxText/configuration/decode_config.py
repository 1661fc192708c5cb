"""The decode and serving group: decode.py's prompt and sampling, the engine's cache layout, stored
weight quantization, speculative decoding, and the server's serve_* limits. Checked here without I/O
(a draft model's keys and a tokenizer are read where the engine is built)."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from MaxText.configuration import config_yaml
from MaxText.configuration.config_fields import key, read_keys
from MaxText.configuration.config_fields import require as _require, warn_once
from MaxText.configuration.model_checks import FLOAT32_MAX, one_of as _one_of
from MaxText.errors import ConfigError

SAMPLING_STRATEGIES = ("greedy", "weighted", "nucleus", "topk")
KV_CACHE_LAYOUTS = ("dense", "paged")
WEIGHT_QUANTIZATION_MODES = ("", "int8", "fp8")  # quantize_weights: layers/weight_quantization.py stores each
# Keys that once were booleans and now take auto | true | false (auto: where it applies); an old
# config's True / False reads as true / false.
AUTO_SWITCHES = ("prefix_caching",)
AUTO_SWITCH_VALUES = ("auto", "true", "false")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeConfig:
  prompt: str = key()
  prompt_token_ids: tuple[int, ...] = key()  # empty = tokenize `prompt`
  prompt_chat_template: bool = key()  # `prompt` as one user turn in the tokenizer's chat template
  image_path: str = key()  # decode: images for a vision-language prompt, comma-separated (local or gs://)
  max_prefill_predict_length: int = key()
  decode_sampling_strategy: str = key()
  decode_sampling_temperature: float = key()
  decode_sampling_top_p: float = key()
  decode_sampling_top_k: int = key()
  decode_sampling_seed: int = key()
  quantize_kvcache: bool = key()
  quantize_weights: str = key()  # "" | int8 | fp8: the decoder stack's kernels stored 8-bit (inference/quantized_weights.py)
  quantize_weights_block: int = key()  # input rows per scale; 0: one scale per output channel
  host: str = key()  # MaxText.serve: the address the HTTP server binds
  port: int = key()
  serve_model_name: str = key()  # the model id clients name; "" = model_name
  serve_max_slots: int = key()  # requests decoded together (the engine's slots)
  serve_max_queue: int = key()  # requests waiting for a slot before new ones get 503
  serve_max_tokens: int = key()  # the most new tokens one request may ask for
  serve_max_n: int = key()  # the most completions (prompts x n) one request may ask for
  serve_max_body_bytes: int = key()
  serve_max_images: int = key()  # the most images one chat request may bring
  serve_max_image_bytes: int = key()  # one image's encoded size
  serve_max_image_pixels: int = key()  # one image's width x height
  serve_request_timeout_seconds: float = key()
  serve_read_timeout_seconds: float = key()  # a request's head, then its body, must arrive within this (else 408)
  serve_http_processes: int = key()  # 0: HTTP in the engine's process; N: N front-end processes (serve_processes.py)
  serve_lora_adapters: tuple[str, ...] = key()  # name=path PEFT LoRA adapters served beside the base model
  serve_lora_slots: int = key()  # adapters held at once (admin routes add more); 0: as many as serve_lora_adapters
  serve_lora_max_rank: int = key()  # the adapter tables' rank; 0: the largest serve_lora_adapters rank
  kv_cache_layout: str = key()  # dense: [slots, max_target_length] per layer; paged: a pool of pages
  kv_page_size: int = key()
  kv_num_pages: int = key()  # 0: as many as slots x pages per slot (the dense capacity)
  prefill_chunk_size: int = key()  # paged serving: prompt tokens prefilled per step; 0 = a whole prompt at once
  prefix_caching: str = key()  # auto | true | false: full prompt pages shared between requests (paged layout)
  prefix_state_snapshots: int = key()  # recurrent models' states kept at page boundaries; -1: 2 per slot, 0: none
  decode_steps_per_call: int = key()  # generate steps per host round trip (a device-side loop); 1 = one
  speculative_tokens: int = key()  # speculative decoding: draft tokens proposed per round; 0 = off
  draft_model_name: str = key()  # the draft's configs/models/<name>.yml ("" = saved beside its checkpoint)
  draft_load_parameters_path: str = key()  # the draft's parameters
  draft_overrides: tuple[str, ...] = key()  # key=value model keys for the draft only

  @classmethod
  def from_values(cls, v: Mapping[str, Any]) -> "DecodeConfig":
    _one_of(v, "decode_sampling_strategy", SAMPLING_STRATEGIES)
    _one_of(v, "kv_cache_layout", KV_CACHE_LAYOUTS)
    _one_of(v, "quantize_weights", WEIGHT_QUANTIZATION_MODES)
    _require(v["quantize_weights_block"] >= 0, f"quantize_weights_block must be >= 0 (0: one scale per output "
             f"channel), got {v['quantize_weights_block']}")
    _require(v["quantize_weights_block"] == 0 or v["quantize_weights"] != "",
             f"quantize_weights_block={v['quantize_weights_block']} needs quantize_weights=int8 or fp8 (it sizes their "
             "scales' blocks); set quantize_weights or quantize_weights_block=0")
    if 0 < v["quantize_weights_block"] <= 4:  # a float32 scale per 4 or fewer 8-bit weights: 2 bytes a weight or more
      warn_once(f"warning: quantize_weights_block={v['quantize_weights_block']} stores a float32 scale per "
                f"{v['quantize_weights_block']} weight(s): as many bytes a weight as bfloat16 or more, so it saves no "
                "memory; use a block of 32 to 128, or 0 (one scale per output channel)")
    _require(v["kv_page_size"] >= 1, f"kv_page_size must be >= 1, got {v['kv_page_size']}")
    # Before the products below, which a negative count would pass (and blame another key for).
    _require(v["serve_max_slots"] >= 1, f"serve_max_slots must be >= 1, got {v['serve_max_slots']}")
    # The cache's positions and pages are int32 indices on the device (and a host page table per slot).
    positions = v["serve_max_slots"] * v["max_target_length"]
    _require(positions < 2**31, f"serve_max_slots {v['serve_max_slots']} x max_target_length {v['max_target_length']} "
             f"= {positions:.3g} cache positions, over the 2**31 this project accepts: lower serve_max_slots")
    _require(v["kv_num_pages"] * v["kv_page_size"] < 2**31, f"kv_num_pages {v['kv_num_pages']} x kv_page_size "
             f"{v['kv_page_size']} = {v['kv_num_pages'] * v['kv_page_size']:.3g} cache positions, over the 2**31 this "
             "project accepts: lower kv_num_pages")
    # kv_num_pages=0 is the dense capacity in whole pages: one page of kv_page_size positions a slot at least.
    pages = v["serve_max_slots"] * -(-max(v["max_target_length"], 1) // v["kv_page_size"])
    _require(v["kv_num_pages"] or v["kv_cache_layout"] != "paged" or pages * v["kv_page_size"] < 2**31,
             f"kv_page_size={v['kv_page_size']} makes the paged cache {pages} pages x "
             f"{v['kv_page_size']} = {pages * v['kv_page_size']:.3g} cache positions (kv_num_pages=0: a slot's "
             f"max_target_length={v['max_target_length']} in whole pages), over the 2**31 this project accepts: "
             "lower kv_page_size")
    _require(v["kv_num_pages"] >= 0, f"kv_num_pages must be >= 0 (0: enough for every slot at max_target_length), "
             f"got {v['kv_num_pages']}")
    _require(v["prefix_state_snapshots"] >= -1, f"prefix_state_snapshots must be >= -1 (-1: 2 per slot, 0: none), "
             f"got {v['prefix_state_snapshots']}")
    _require(v["prefill_chunk_size"] >= 0, f"prefill_chunk_size must be >= 0 (0: no chunking), got "
             f"{v['prefill_chunk_size']}")
    # One call's chunk budget is shared by the slots' prompts: more than they can all hold is never spent, and
    # would only size the call's host buffers.
    _require(v["prefill_chunk_size"] <= positions, f"prefill_chunk_size={v['prefill_chunk_size']} is more than the "
             f"{positions} prompt tokens serve_max_slots x max_target_length can hold: lower prefill_chunk_size")
    _require(v["prefill_chunk_size"] == 0 or v["kv_cache_layout"] == "paged",
             f"prefill_chunk_size={v['prefill_chunk_size']} needs kv_cache_layout=paged (chunks are prefilled "
             "straight into the slot's pages); set kv_cache_layout=paged or prefill_chunk_size=0")
    _one_of(v, "prefix_caching", AUTO_SWITCH_VALUES)
    _require(v["prefix_caching"] != "true" or v["kv_cache_layout"] == "paged",
             "prefix_caching=true needs kv_cache_layout=paged (requests share their prompts' cached pages); set "
             "kv_cache_layout=paged or prefix_caching=auto (on where the cache has pages)")
    _require(v["speculative_tokens"] >= 0, f"speculative_tokens must be >= 0 (0: no speculative decoding), got "
             f"{v['speculative_tokens']}")
    _require(v["decode_steps_per_call"] >= 1, f"decode_steps_per_call must be >= 1 (1: one token per call), got "
             f"{v['decode_steps_per_call']}")
    # A slot runs at most max_target_length steps; more would only size the call's token buffers (memory).
    for name in ("decode_steps_per_call", "speculative_tokens"):
      _require(v[name] <= v["max_target_length"], f"{name}={v[name]} is more than max_target_length="
               f"{v['max_target_length']} (no slot runs that many steps); set it to at most {v['max_target_length']}")
    _require(v["decode_steps_per_call"] == 1 or v["speculative_tokens"] == 0,
             f"decode_steps_per_call={v['decode_steps_per_call']} does not combine with speculative_tokens="
             f"{v['speculative_tokens']} (a speculative round already emits several tokens per call); set one of "
             "them to its default")
    for item in v["draft_overrides"]:
      _require("=" in str(item) and bool(str(item).partition("=")[0].strip()),
               f"draft_overrides items are key=value (e.g. base_num_decoder_layers=2), got {item!r}")
    # Checked against max_target_length by the decode engine only: training runs never read it.
    prefill = v["max_prefill_predict_length"]
    _require(prefill > 0, f"max_prefill_predict_length must be > 0, got {prefill}")
    # inf (or past float32's largest, inf on the device) would sample every token alike, whatever the model says.
    # 0 is what "greedy" means elsewhere (the serving API): greedy reads no temperature, so it takes 0 as well.
    temperature, strategy = v["decode_sampling_temperature"], v["decode_sampling_strategy"]
    _require(temperature != 0 or strategy == "greedy",
             f"decode_sampling_temperature=0 does not combine with decode_sampling_strategy={strategy} (sampling divides "
             "the logits by the temperature); for greedy decoding set decode_sampling_strategy=greedy, else give a "
             "temperature > 0 (e.g. 0.8)")
    _require(temperature == 0 or 0 < temperature <= FLOAT32_MAX,
             f"decode_sampling_temperature must be > 0 and a finite float32 number, got {temperature}")
    # The engine's sampler keys are uint32 seeds (a negative or larger one stopped decode with a traceback).
    _require(0 <= v["decode_sampling_seed"] < 2**32,
             f"decode_sampling_seed must be in [0, 2**32) (an unsigned 32-bit seed), got {v['decode_sampling_seed']}")
    _require(0 < v["decode_sampling_top_p"] <= 1,
             f"decode_sampling_top_p must be in (0, 1], got {v['decode_sampling_top_p']}")
    # Only topk reads it: its default (40) must not refuse a smaller vocabulary's training or other strategies.
    top_k_bound = v["vocab_size"] if strategy == "topk" else float("inf")
    _require(1 <= v["decode_sampling_top_k"] <= top_k_bound,
             f"decode_sampling_top_k must be between 1 and vocab_size={v['vocab_size']}, got {v['decode_sampling_top_k']}")
    ids = config_yaml.whole_numbers("prompt_token_ids", v["prompt_token_ids"], "5,17,42")
    config_yaml.split_items("image_path", v["image_path"])  # its empty item refused before a model loads
    outside = next((i for i, t in enumerate(ids) if not 0 <= t < v["vocab_size"]), None)
    if outside is not None:  # the first one, not the whole list
      raise ConfigError(f"prompt_token_ids must lie in [0, vocab_size={v['vocab_size']}); item {outside + 1} is "
                        f"{ids[outside]}")
    _require(len(ids) <= prefill, f"prompt_token_ids has {len(ids)} tokens, more than max_prefill_predict_length="
             f"{prefill}; raise max_prefill_predict_length or shorten the prompt")
    _require(bool(str(v["host"]).strip()), "host must name an address to bind, e.g. 127.0.0.1")
    _require(0 <= v["port"] <= 65535, f"port must be in [0, 65535] (0 = any free port), got {v['port']}")
    for name in ("serve_max_tokens", "serve_max_n", "serve_max_body_bytes", "serve_max_image_bytes",
                 "serve_max_image_pixels"):
      _require(v[name] >= 1, f"{name} must be >= 1, got {v[name]}")
    _require(v["serve_max_queue"] >= 0, f"serve_max_queue must be >= 0, got {v['serve_max_queue']}")
    _require(v["serve_lora_slots"] >= 0 and v["serve_lora_max_rank"] >= 0,
             f"serve_lora_slots and serve_lora_max_rank must be >= 0, got {v['serve_lora_slots']} and "
             f"{v['serve_lora_max_rank']}")
    _require(v["serve_lora_max_rank"] == 0 or bool(v["serve_lora_adapters"]) or v["serve_lora_slots"] > 0,
             f"serve_lora_max_rank={v['serve_lora_max_rank']} sizes LoRA adapter tables, which a server has only with "
             "serve_lora_adapters or serve_lora_slots >= 1; set serve_lora_slots=N to add adapters later through the "
             "admin routes, or serve_lora_max_rank=0")
    _require(v["serve_max_images"] >= 0, f"serve_max_images must be >= 0 (0: no images), got {v['serve_max_images']}")
    _require(v["serve_http_processes"] >= 0, f"serve_http_processes must be >= 0 (0: HTTP in the engine's process), "
             f"got {v['serve_http_processes']}")
    for name in ("serve_request_timeout_seconds", "serve_read_timeout_seconds"):
      _require(v[name] > 0, f"{name} must be > 0, got {v[name]}")
    return cls(**read_keys(cls, v, prompt_token_ids=ids))
