"""The tokenizer as the server uses it (openai_api.Codec), built from plain values and without JAX, so
the engine's process (serve.py) and each HTTP front-end process (serve_frontend.py) build the same one."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable

from MaxText.errors import ConfigError, UserError
from MaxText.inference import grammar, image_chat, tool_calls
from MaxText.inference import openai_api as api
from MaxText.input_pipeline import chat as chat_lib
from MaxText.input_pipeline.tokenizer import DocumentEncoder, load_tokenizer

# (the chat template's tokenizer, messages with image parts) -> (ids, image_prompts.PromptImages)
ImageChat = Callable[[Any, list[dict[str, Any]]], tuple[list[int], Any]]


@dataclasses.dataclass(frozen=True)
class CodecSpec:
  """The config keys the codec reads (picklable: the engine sends it to its front ends)."""
  tokenizer_type: str
  tokenizer_path: str
  add_bos: bool
  vocab_size: int  # the model's
  # Chats with images (the model's vision config and image format, the server's image limits); None: no images.
  # A front end decodes and cuts the images itself and sends their pixel values with the submit: the
  # engine's process then only unpickles an array, its scheduler thread's interpreter lock left alone.
  images: image_chat.ImageChat | None = None


PROBE_CHAT = [{"role": "user", "content": "hi"}]  # a conversation every chat template renders


def build(spec: CodecSpec, chat_images: ImageChat | None = None, probe_chat: bool = False
          ) -> tuple[api.Codec, int | None]:
  """The codec and the tokenizer's end-of-sequence id; `chat_images` (else `spec.images`) renders chats with images.
  `probe_chat` (the server, once): a chat template that fails on PROBE_CHAT other than by its own raise_exception
  would fail every chat request, each a 400 blaming the client: a UserError naming the file instead."""
  if not spec.tokenizer_path:
    raise UserError("MaxText.serve needs tokenizer_path=... (clients send and receive text)")
  tokenizer = load_tokenizer(spec.tokenizer_type, spec.tokenizer_path)
  if tokenizer.vocab_size > spec.vocab_size:
    raise UserError(f"the tokenizer {spec.tokenizer_path} has {tokenizer.vocab_size} tokens but the model's "
                    f"vocab_size is {spec.vocab_size}: this tokenizer does not belong to this checkpoint")
  encode = DocumentEncoder(tokenizer, spec.add_bos, add_eos=False)
  chat_tokenizer: list[Any] = []
  # The first chats arrive together on worker threads (asyncio.to_thread): the chat tokenizer and the grammar compiler
  # (each reads the whole vocabulary) are built once, by one of them, while the others wait. (load_chat_tokenizer is
  # itself safe on several threads.) grammars() builds under it too, and calls template_tokenizer.
  building = threading.RLock()

  def template_tokenizer() -> Any:
    try:
      with building:
        if not chat_tokenizer:
          chat_tokenizer.append(chat_lib.load_chat_tokenizer(spec.tokenizer_path, needs="/v1/chat/completions"))
    except ConfigError as e:
      raise api.ApiError(400, str(e)) from None
    return chat_tokenizer[0]

  def rendered(messages: list[dict[str, Any]], **tools: Any) -> list[int]:
    """The conversation's ids; the template's own refusal (raise_exception: roles that do not alternate, a role
    it does not know) or failure on what the client sent (a past call's arguments nested past the stack's depth,
    a TypeError on a field's type) is the client's 400."""
    chat_tokenizer = template_tokenizer()  # its own 400 when the tokenizer has no template
    try:
      guard = chat_lib.ContentGuard(chat_tokenizer, messages, tools)  # a typed "<|im_end|>" stays text
    except UserError as e:
      raise api.ApiError(400, f"messages: {e}", "messages") from None
    try:
      text = chat_tokenizer.apply_chat_template(guard.hide(messages), tokenize=False, add_generation_prompt=True,
                                                **guard.hide(tools))
    except Exception as e:  # noqa: BLE001 - jinja's TemplateError, or the template's code failing on the input
      raise api.ApiError(400, f"messages: the chat template of {spec.tokenizer_path} refuses them: "
                         f"{' '.join(str(e).split())[:300] or type(e).__name__}", "messages") from None
    return guard.encode(chat_tokenizer, text)[0]

  def chat(messages: list[dict[str, Any]]) -> list[int]:
    return rendered(messages)

  def chat_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[int]:
    template = template_tokenizer().chat_template
    if not isinstance(template, str) or "tools" not in template:  # it would drop them without a word
      raise api.ApiError(400, f"tools: the chat template of {spec.tokenizer_path} does not render tools; serve a "
                         "tokenizer whose template does", "tools", "unsupported_parameter")
    return rendered(messages, tools=tools)

  images = None
  if chat_images is None and spec.images is not None:
    chat_images = spec.images.ids
  if chat_images is not None:
    render = chat_images

    def images_of(messages: list[dict[str, Any]]) -> tuple[list[int], Any]:
      return render(template_tokenizer(), messages)

    images = images_of

  compilers: list[grammar.Compiler] = []

  def grammars() -> grammar.Compiler:
    """Built at the first constrained request: it reads the whole vocabulary."""
    with building:
      if not compilers:
        try:
          eos = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
          compilers.append(grammar.Compiler(template_tokenizer(), spec.vocab_size, eos))
        except ValueError as e:  # llguidance reads Hugging Face fast tokenizers only
          raise api.ApiError(400, f"response_format and forced tool calls need a Hugging Face fast tokenizer: {e}",
                             "response_format", "unsupported_parameter") from None
    return compilers[0]

  def tool_format() -> str:
    return tool_calls.template_format(template_tokenizer().chat_template)

  if probe_chat:
    _probe(template_tokenizer, spec.tokenizer_path)
  return (api.Codec(encode, tokenizer.decode, chat, images, chat_tools, grammars, tool_format, tokenizer.vocab_size,
                    getattr(tokenizer, "special_id", None)), tokenizer.eos_id)


def _probe(template_tokenizer: Callable[[], Any], path: str) -> None:
  """Renders PROBE_CHAT with the chat template; a template's own refusal (raise_exception: jinja's TemplateError
  itself, e.g. a system turn it requires) passes: it refuses some conversations, not necessarily all."""
  import jinja2

  try:
    chat_tokenizer = template_tokenizer()
  except api.ApiError:
    return  # no chat template: the chat route answers that itself, and completions still work
  try:
    chat_tokenizer.apply_chat_template(PROBE_CHAT, tokenize=False, add_generation_prompt=True)
  except Exception as e:  # noqa: BLE001 - whatever the template's code raises
    if type(e) is jinja2.TemplateError:
      return
    raise UserError(f"the chat template of {path} fails on a one-message conversation, so every chat request would: "
                    f"{type(e).__name__}: {' '.join(str(e).split())[:200]}") from None
