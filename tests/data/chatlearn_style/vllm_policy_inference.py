# chatgen generate --module vllm_policy_inference:StylePolicyInference --config sampler.yaml --config-dialect chatlearn ...
"""A policy inference model file written the way ChatLearn v1.0's examples write theirs (our own code, in its
idiom: a torch Dataset with a collate_fn, `model_args` user keys, `self.tokenizer.tokenizer`, `_add_request`
on the collated batch, `_add_request_internal`, `eval_forward`, a dict out of `decode_internal`).

The only line that differs from a ChatLearn model file is the import: `from chatlearn import VLLMModule`.
Run unchanged by tests/integration/test_chatlearn_port.py, with the ChatLearn-style YAML chain beside it.
"""

import copy
import random
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from chatgen import VLLMModule


class StylePromptDataset(Dataset):
    """Prompts as {"input_ids", "prompt"} dicts, cut to max_prompt_length tokens from the right."""

    def __init__(self, prompts, max_prompt_length, tokenizer, prompt_key=None):
        assert max_prompt_length > 0, "max_prompt_length must be positive"
        self.data = []
        for prompt in prompts:
            text = prompt[prompt_key] if prompt_key is not None else prompt
            self.data.append(
                {"input_ids": tokenizer.encode(text)[:max_prompt_length], "prompt": text}
            )

    def __getitem__(self, ix):
        return self.data[ix]

    def __len__(self):
        return len(self.data)

    def collate_fn(self, samples):
        batch = defaultdict(list)
        for sample in samples:
            for key, value in sample.items():
                batch[key].append(value)
        return batch


class StylePolicyInference(VLLMModule):
    """Policy inference in ChatLearn's idiom."""

    def build_dataset(self, train_prompts, is_eval=False):
        if is_eval:
            prompts = train_prompts
        elif self.model_args["shuffle_mode"] == 1:
            # each prompt samples_per_prompt times, the copies shuffled (a fixed seed: reproducible)
            prompts = []
            for _ in range(self.model_args["samples_per_prompt"]):
                copies = copy.deepcopy(list(train_prompts))
                random.Random(self.model_args["seed"]).shuffle(copies)
                prompts.extend(copies)
        else:
            raise ValueError(f"unsupported shuffle_mode {self.model_args['shuffle_mode']}")
        max_prompt_length = self.model_args.get("seq_length") - self.model_args.get(
            "max_new_tokens"
        )
        return StylePromptDataset(
            prompts,
            max_prompt_length,
            self.tokenizer.tokenizer,
            self.model_args.get("question_key"),
        )

    def _add_request(self, data, is_eval=False):
        return self._add_request_internal(data["prompt"], data["input_ids"], is_eval=is_eval)

    def forward_step(self, data, iteration=0):
        return self._forward_step(data, iteration, eval_mode=False)

    def eval_forward(self, data, iteration=0):
        return self._forward_step(data, iteration, eval_mode=True)

    def _forward_step(self, data, iteration, eval_mode):
        assert iteration >= 0
        assert isinstance(eval_mode, bool)
        return self.execute_step(data)

    def decode_internal(self, batched_outputs):
        max_tokens_length = self.model_args.get("seq_length")
        pad_id = self.tokenizer.tokenizer.eos_token_id
        all_tokens, str_prompts, str_outputs, logprobs, prompt_sizes = [], [], [], [], []
        for output in batched_outputs:
            for response in output.outputs:
                str_prompts.append(output.prompt)
                str_outputs.append(response.text)
                prompt_sizes.append(len(output.prompt_token_ids))
                tokens = list(output.prompt_token_ids) + list(response.token_ids)
                all_tokens.append(
                    F.pad(torch.tensor(tokens), (0, max_tokens_length - len(tokens)), value=pad_id)
                )
                sampled = [
                    step[token].logprob
                    for step, token in zip(response.logprobs, response.token_ids)
                ]
                logprob = torch.tensor([0.0] * (len(output.prompt_token_ids) - 1) + sampled)
                logprobs.append(
                    F.pad(logprob, (0, max_tokens_length - 1 - logprob.shape[0]), value=0.0)
                )
        all_tokens = torch.vstack(all_tokens)
        positions = torch.arange(max_tokens_length)[None, :]
        prompt_sizes = torch.tensor(prompt_sizes)
        loss_mask = (positions >= prompt_sizes[:, None]) & (all_tokens != pad_id)
        return {
            "all_tokens": all_tokens,
            "str_prompts": str_prompts,
            "str_outputs": str_outputs,
            "logprobs": torch.vstack(logprobs),
            "loss_mask": loss_mask.long(),
            "prompt_sizes": prompt_sizes,
        }
