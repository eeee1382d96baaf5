"""`LLM`: the offline entry point, in the shape vLLM users know."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from collections.abc import Sequence as Seq
from typing import Any

import torch
from tqdm.auto import tqdm

from extkv.engine.chat_content import MediaSources, chat_inputs, content_format
from extkv.engine.config import EngineConfig
from extkv.engine.errors import RequestFailedError
from extkv.engine.llm_engine import LLMEngine
from extkv.engine.outputs import RequestOutput
from extkv.engine.sampling_params import SamplingParams
from extkv.options import check_names

# Text, {"prompt": text} or {"prompt_token_ids": ids}; a dict may add "multi_modal_data":
# {"image": a PIL image or a list of them}, one image placeholder in the prompt per image.
Prompt = str | Mapping[str, Any]
Conversation = Seq[Mapping[str, Any]]  # [{"role": ..., "content": ...}, ...]
_PROMPT_KEYS = {"prompt", "prompt_token_ids", "multi_modal_data"}


class LLM:
    """Load a checkpoint folder, size the KV cache, and generate.

    `LLM(path, enable_extensible_kv_cache=True)` sizes the KV cache after CUDA
    graph capture from the memory really left; the default legacy path sizes
    it before, from an estimate. The options are `EngineConfig`'s fields (the
    same as `extkv generate --help` lists).

    `tensor_parallel_size=N` splits the model over N ranks: this process and N - 1
    worker processes it starts (one device each on CUDA). A script that uses it
    needs the `if __name__ == "__main__":` guard, as every `spawn` program does;
    under `torchrun` the ranks are torchrun's and `LLM(...)` on ranks > 0 serves
    rank 0 until it closes, then exits.
    """

    def __init__(self, model: str, **options: Any) -> None:
        check_names(EngineConfig, options, "LLM()")
        self.engine = LLMEngine(EngineConfig(model=model, **options))

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        """An LLM of a config already checked (the command line builds one before loading)."""
        llm = cls.__new__(cls)
        llm.engine = LLMEngine(config)
        return llm

    def memory_report(self) -> dict[str, object]:
        """How start-up spent memory and time (KV cache, graph pool, blocks) as a plain dict."""
        return self.engine.memory_report.as_dict()

    def close(self) -> None:
        """Free the device memory now rather than when the object is collected."""
        self.engine.close()

    def resize_kv_cache(
        self, num_blocks: int | None = None, memory_bytes: int | None = None
    ) -> dict[str, object]:
        """Grow or shrink the committed KV cache to `num_blocks`, or to the most whole blocks
        (and granules) `memory_bytes` holds, under the CUDA graphs captured at start-up;
        return what was done (`num_blocks` and `committed_bytes`: the size committed now).
        Needs the extensible KV cache."""
        return self.engine.resize_kv_cache(num_blocks, memory_bytes).as_dict()

    def kv_cache_status(self) -> dict[str, object]:
        """The KV cache now: blocks committed, capacity and in use, bytes, resizes so far."""
        return self.engine.kv_cache_status()

    def sleep(self, level: int = 1, drain: bool = False) -> list[RequestOutput]:
        """As vLLM's sleep mode (`enable_sleep_mode=True`): give back the KV cache's memory
        and move the weights to host memory (level 1) or drop them (level 2: see `wake_up`).
        `drain` first finishes requests still running (added through `engine`) and returns
        their outputs; without it they are an error."""
        return self.engine.sleep(level, drain)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Map back "weights" and/or "kv_cache" (None: both) under the same addresses; the
        CUDA graphs captured at start-up replay unchanged, the prefix cache starts empty.

        After `sleep(level=2)`, waking the weights maps their memory back but fills no
        parameter: call `load_weights` then (new weights, e.g. from a trainer), or let the
        engine read the checkpoint again, which it does once it is fully awake with the
        parameters still unfilled. So `wake_up(tags=["weights"])`, `load_weights(...)`,
        `wake_up(tags=["kv_cache"])` reads no checkpoint, and `wake_up()` reads it."""
        self.engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        """Whether the weights or the KV cache sleep (or, after a level-2 sleep, the
        parameters wait to be filled)."""
        return self.engine.is_sleeping()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy new weights into the model, in place (same addresses: the CUDA graphs stay
        valid), on every tensor-parallel rank: `weights` are (name, tensor) pairs named as in
        the checkpoint (transformers' `model.state_dict()`), any dtype and device, full
        tensors (each rank takes its shard). A subset updates just those parameters; after
        `sleep(level=2)` and `wake_up(tags=["weights"])` every parameter must be given.
        All pairs are checked before any is copied (a generator is read whole first): an
        unknown or missing name or a wrong shape is a ValueError that names it, and nothing
        is loaded. The engine must be idle; the prefix cache is emptied."""
        self.engine.load_weights(weights)

    def get_tokenizer(self):  # -> PreTrainedTokenizerBase | None
        """The checkpoint's tokenizer, or None where the folder has none (token ids only)."""
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Seq[Prompt] | None = None,
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        prompt_token_ids: Seq[int] | Seq[Seq[int]] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs keep the input order. A prompt is a string,
        `{"prompt": text}` or `{"prompt_token_ids": ids}` (vLLM's text and tokens prompts),
        the dicts with `"multi_modal_data": {"image": image or [images]}` for a
        vision-language model (one placeholder token per image in the prompt, expanded by
        the engine); `prompt_token_ids=` takes one list of ids or a list of them."""
        requests = self._requests(prompts, prompt_token_ids)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(requests)
        else:
            params = list(sampling_params)
            if len(params) != len(requests):
                raise ValueError(
                    f"sampling_params has {len(params)} entries for {len(requests)} prompts"
                )
        engine = self.engine
        order: dict[str, int] = {}
        try:
            for (text, ids, data), p in zip(requests, params, strict=True):
                ids, images = engine.process_multimodal(ids, data)
                order[engine.add_request(ids, p, prompt=text, images=images)] = len(order)
        except Exception:
            for request_id in order:  # all or nothing: a bad prompt queues none
                engine.abort_request(request_id)
            raise
        results: list[RequestOutput | None] = [None] * len(requests)
        try:
            with tqdm(total=len(requests), desc="generate", disable=not use_tqdm) as bar:
                while engine.has_unfinished_requests():
                    for output in engine.step(finished_only=True):
                        if output.error is not None:
                            raise RequestFailedError(output.request_id, output.error)
                        results[order[output.request_id]] = output
                        bar.update(1)
        except BaseException:
            # Whatever stopped this call (a failed request, Ctrl-C), none of its requests
            # stays queued: the next call starts from an idle engine.
            for request_id, i in order.items():
                if results[i] is None:
                    engine.abort_request(request_id)
            raise
        return [r for r in results if r is not None]

    def chat(
        self,
        messages: Conversation | Seq[Conversation],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of `{"role", "content"}` messages)
        or to a list of them, through the tokenizer's chat template (or `chat_template`).
        A content may be OpenAI's list of parts, images among them (`{"type": "image_url",
        "image_url": {"url": "data:image/png;base64,..."}}`, file:// URLs inside
        allowed_local_media_path, or `{"type": "image_pil", "image_pil": image}`)."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError(f"chat needs a tokenizer, and {self.engine.config.model} has none")
        if not isinstance(messages, Seq) or not messages:
            raise ValueError("messages must be a non-empty list of messages or of conversations")
        conversations = [messages] if isinstance(messages[0], Mapping) else list(messages)
        fmt = content_format(chat_template or getattr(tokenizer, "chat_template", None))
        placeholder = self.engine.image_placeholder
        sources = MediaSources.of(self.engine.config)
        prompts = []
        for conversation in conversations:
            turns, images = chat_inputs(conversation, fmt, placeholder, sources)
            text = tokenizer.apply_chat_template(
                turns,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
            )
            # The template writes the special tokens (BOS and the turn markers) itself.
            ids = tokenizer.encode(text, add_special_tokens=False)
            prompt = {"prompt_token_ids": ids, "prompt": text}
            prompts.append({**prompt, "multi_modal_data": {"image": images}} if images else prompt)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _requests(
        self,
        prompts: Prompt | Seq[Prompt] | None,
        prompt_token_ids: Seq[int] | Seq[Seq[int]] | None,
    ) -> list[tuple[str | None, list[int], Mapping[str, Any] | None]]:
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("pass exactly one of prompts or prompt_token_ids")
        if prompts is not None:
            single = isinstance(prompts, str | Mapping)
            items = [prompts] if single else list(prompts)
            if not items:
                raise ValueError("prompts must not be empty")
            return [self._request(item) for item in items]
        ids = list(prompt_token_ids)
        if not ids:
            raise ValueError("prompt_token_ids must not be empty")
        nested = ids if isinstance(ids[0], list | tuple) else [ids]
        return [(None, list(p), None) for p in nested]

    def _request(self, prompt: Prompt) -> tuple[str | None, list[int], Mapping[str, Any] | None]:
        """(text, token ids, multi_modal_data) of one prompt given as a string or a
        vLLM-style dict."""
        if isinstance(prompt, str):
            return prompt, self.engine.encode(prompt), None
        if isinstance(prompt, Mapping):
            unknown = sorted(set(prompt) - _PROMPT_KEYS)
            if unknown:
                raise ValueError(
                    "a prompt dict takes 'multi_modal_data' (optional) and 'prompt' (text) or "
                    f"'prompt_token_ids'; got {unknown}"
                )
            data = prompt.get("multi_modal_data")
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"]), data
            if isinstance(prompt.get("prompt"), str):
                return prompt["prompt"], self.engine.encode(prompt["prompt"]), data
        raise ValueError(
            "each prompt must be a string, {'prompt': text} or {'prompt_token_ids': [ids]}; "
            f"got {prompt!r:.80}"
        )
