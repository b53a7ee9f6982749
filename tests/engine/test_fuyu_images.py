"""Images through Fuyu checkpoints (multimodal/fuyu.py: no tower, patches into Persimmon) vs HF.

A tiny random `FuyuForCausalLM` (a 2-layer Persimmon, 8-pixel patches, images fitted into and
padded to 32 x 40: at most 4 rows of 5 patches, each row ended by |NEWLINE|) with a word-level
tokenizer that, as Fuyu's SentencePiece one, writes a "▁" first in every text it tokenizes (HF's
FuyuProcessor drops that first token of its image rows; a tokenizer without one loses an image
token there). `LLM.generate` with `multi_modal_data` must give FuyuProcessor's prompt ids (rows,
<s>, the prompt, <0x04>) and HF `generate`'s greedy tokens and top-5 logprobs (1e-3, float32)
for images smaller than the canvas, larger (shrunk) and tall; then chunks through the image,
prefix-cache hits, an image processed ahead, and bad input refused by name. Fuyu has no chat
template (nothing to send as a chat image_url).

transformers' FuyuProcessor cannot run its PIL image processor (what it builds without
torchvision): its patchify_image gets the torch tensors the processor asked for and calls numpy's
transpose on them. The reference runs it on their numpy copies (the torchvision class's patches
are the same: rows of (p, p, channel) patches).
"""

from __future__ import annotations

import pytest
import torch
from hf_reference import assert_same_greedy
from image_checks import (
    check_chunks_and_prefix_hits,
    check_matches_hf,
    check_refused,
    engine,
    greedy,
    hf_refs,
    noise_image,
)
from vlm_checkpoints import load_hf_vlm

from paged_engine.testing import _save_random, tiny_config

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
Image = pytest.importorskip("PIL.Image")

PATCH, CANVAS = 8, {"height": 32, "width": 40}
PROMPT = "what is the picture of"
OTHER = "caption the cat"
SPECIALS = ["<unk>", "<s>", "|ENDOFTEXT|", "<pad>", "<0x04>"]
WORDS = ["what", "is", "the", "picture", "of", "a", "cat", "dog", "caption", "colour", "it"]


def _tokenizer():
    """Fuyu's tokenizer in small: "▁" prepended to each text, spaces as "▁", |SPEAKER| and
    |NEWLINE| plain vocabulary tokens, <s> / <0x04> special."""
    from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers

    vocab = [*SPECIALS, "▁", "|SPEAKER|", "|NEWLINE|", *(f"▁{w}" for w in WORDS)]
    vocab += [f"▁w{i}" for i in range(128 - len(vocab))]
    tok = tokenizers.Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, "<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"▁[^▁|]*|\|[A-Z]+\|"), behavior="isolated")
    tok.decoder = decoders.Metaspace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="|ENDOFTEXT|",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=["<0x04>"],
    )


def write_tiny_fuyu(path, seed: int = 0):
    """A tiny random Fuyu checkpoint with its processor (image processor and tokenizer)."""
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer()
    ids = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}
    text = tiny_config("persimmon", vocab_size=len(tokenizer), **ids).to_dict()
    config = transformers.FuyuConfig(
        text_config=text,
        patch_size=PATCH,
        num_channels=3,
        image_token_id=tokenizer.convert_tokens_to_ids("|SPEAKER|"),
        **ids,
    )
    _save_random(transformers.FuyuForCausalLM, config, seed, path)
    images = transformers.FuyuImageProcessor(
        size=CANVAS, patch_size={"height": PATCH, "width": PATCH}
    )
    transformers.FuyuProcessor(image_processor=images, tokenizer=tokenizer).save_pretrained(path)
    transformers.GenerationConfig(**ids).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_fuyu(tmp_path_factory.mktemp("fuyu"), seed=4)


def _hf_inputs(path, text: str, images: list) -> tuple[list[int], dict]:
    """FuyuProcessor's ids and patches (`pixel_values`), its PIL image processor's patchify
    run on numpy (see the module)."""
    processor = transformers.AutoProcessor.from_pretrained(path)
    if not images:
        return processor.tokenizer.encode(text), {}
    images_cls = type(processor.image_processor)
    patchify = images_cls.patchify_image
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            images_cls,
            "patchify_image",
            lambda self, image, patch_size=None: torch.from_numpy(
                patchify(self, image.numpy(), patch_size)
            ),
        )
        out = processor(
            text=text, images=images, return_tensors="pt", return_legacy_image_output=False
        )
    return out["input_ids"][0].tolist(), {"pixel_values": out["pixel_values"]}


def _prompts() -> list[dict]:
    """PROMPT with a 70 x 50 image (shrunk to 32 x 22: 4 rows of 3 patches; 23 prompt tokens,
    a whole block to hit), a 20 x 13 one (padded: 3 rows of 2) and a 16 x 90 one (shrunk to
    7 x 40: 1 row of 5)."""
    sizes = [(70, 50), (20, 13), (16, 90)]
    return [
        {"prompt": PROMPT, "multi_modal_data": {"image": noise_image(i, size)}}
        for i, size in enumerate(sizes)
    ]


def test_images_match_hf(path):
    """Three image sizes, another text and text alone against HF; HF's expanded ids as
    prompt_token_ids are taken as they are."""
    model = load_hf_vlm(transformers.FuyuForCausalLM, path)
    cases = [(p["prompt"], [p["multi_modal_data"]["image"]]) for p in _prompts()]
    cases += [(OTHER, [noise_image(5, (33, 47))]), (OTHER, [])]
    refs = hf_refs(model, cases, lambda *case: _hf_inputs(path, *case))
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    rows = tokenizer.convert_tokens_to_ids(["|SPEAKER|"] * 2 + ["|NEWLINE|"]) * 3
    assert refs[1][0] == [*rows, 1, *tokenizer.encode(PROMPT), 4]  # 3 rows of 2, <s>, <0x04>
    check_matches_hf(path, cases, refs, "fuyu")


def test_chunks_prefix_hits_and_images_processed_ahead(path):
    """4-token chunks through the image rows give the plain run's tokens; the same image again
    hits the prefix cache, another one nothing (the image comes first); the image processed
    ahead gives the same tokens, and moved one token is refused."""
    prompts = _prompts()
    params = greedy(0, 8)
    plain, cached, run = check_chunks_and_prefix_hits(
        path, prompts, params, 4, lambda proc: proc.images.image_token_id
    )
    images = cached.llm_engine.input_processor.images
    ids, done = images.process(
        cached.get_tokenizer().encode(PROMPT), [prompts[0]["multi_modal_data"]["image"]]
    )
    (m,) = done
    assert (m.image_size, m.break_every, m.length) == ((4, 3), 4, 16)
    ahead = {"prompt_token_ids": ids, "multi_modal_data": {"image": list(done)}}
    assert_same_greedy(plain[:1], run(cached, [ahead]))
    moved = {"prompt_token_ids": [5, *ids], "multi_modal_data": {"image": list(done)}}
    with pytest.raises(ValueError, match="do not fit"):
        cached.generate([moved], params, use_tqdm=False)


def test_bad_input_refused(path):
    """One image a prompt, no |SPEAKER| in the text, no embeddings, images only; hostile or
    patch-breaking mm_processor_kwargs refused by name before (budget) or after the processor
    (not whole patches); the engine serves on."""
    llm = engine(path)
    image = noise_image(9, (20, 20))
    req = {"prompt": PROMPT, "multi_modal_data": {"image": image}}
    two = {"prompt": PROMPT, "multi_modal_data": {"image": [image, image]}}
    cases = [
        (two, "Fuyu takes one image a prompt"),
        ({"prompt": f"|SPEAKER|{PROMPT}", "multi_modal_data": {"image": image}}, "without it"),
        ({"prompt": PROMPT, "multi_modal_data": {"image": torch.zeros(6, 64)}}, "embeddings"),
        ({"prompt": PROMPT, "multi_modal_data": {"image": "a cat"}}, "PIL.Image.Image"),
        ({**req, "mm_processor_kwargs": {"size": {"height": 10**5, "width": 10**5}}}, "'size'"),
        ({**req, "mm_processor_kwargs": {"size": {"height": 20, "width": 36}}}, "whole 8 x 8"),
        ({**req, "mm_processor_kwargs": {"do_pad": False}}, "'do_pad' true"),
        ({**req, "mm_processor_kwargs": {"patch_size": {"height": 4, "width": 4}}}, "patch_size"),
    ]
    check_refused(path, llm, cases, [*_prompts(), two])
    fair = llm.generate([{**req, "mm_processor_kwargs": {"size": {"height": 16, "width": 16}}}])
    assert len(fair[0].prompt_token_ids) == 2 * 3 + 2 + len(llm.get_tokenizer().encode(PROMPT))
