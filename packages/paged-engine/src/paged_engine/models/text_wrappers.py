"""The vision- and audio-language wrappers served text-only (models/multimodal_text.py reads
this table): for each wrapper architecture, the text model class of each text_config.model_type,
the name prefixes of what is dropped (towers, projectors, speech output) and what its text model
does differently from our text class (`Wrapper`'s flags; multimodal_text.py's docstring says why
each is exact).

    wrapper (config.architectures)       text_config.model_type -> our class
    Apertus1p5ForConditionalGeneration   apertus1p5_text        -> Apertus1p5TextForCausalLM
    AriaForConditionalGeneration         aria_text              -> AriaTextForCausalLM
    AyaVisionForConditionalGeneration    cohere2 / cohere       -> Cohere2 / CohereForCausalLM
    Blip2ForConditionalGeneration        opt                    -> OPTForCausalLM
                                         any other (`any_text`) -> its registered *ForCausalLM
    ChameleonForConditionalGeneration    (flat) chameleon       -> ChameleonForCausalLM
    Emu3ForConditionalGeneration         emu3_text_model        -> Emu3ForCausalLM (Llama)
    Cohere2VisionForConditionalGeneration  cohere2              -> Cohere2ForCausalLM
                                         any other (`any_text`) -> its registered *ForCausalLM
    CohereCompassForConditionalGeneration  cohere_compass_text  -> CohereCompassForCausalLM
    DeepseekVLForConditionalGeneration,  llama                  -> LlamaForCausalLM
      DeepseekVLHybridForConditionalGeneration
    JanusForConditionalGeneration        llama                  -> LlamaForCausalLM
    HyperCLOVAXVisionV2ForConditional... hyperclovax            -> HyperCLOVAXForCausalLM
    HCXVisionForCausalLM (remote code)   llama / hyperclovax    -> Llama / HyperCLOVAXForCausalLM
      (HyperCLOVA X SEED Vision v1, text only: models/hcx_vision_v1_config.py)
    Exaone4_5_ForConditionalGeneration   exaone4                -> Exaone4ForCausalLM
    FuyuForCausalLM                      persimmon              -> PersimmonForCausalLM
    Gemma3ForConditionalGeneration       gemma3_text            -> Gemma3ForCausalLM
    Gemma3nForConditionalGeneration      gemma3n_text           -> Gemma3nForCausalLM
    Gemma4ForConditionalGeneration       gemma4_text            -> Gemma4ForCausalLM
    Gemma4UnifiedForConditionalGeneration  gemma4_unified_text  -> Gemma4UnifiedForCausalLM
    PaliGemmaForConditionalGeneration    gemma / gemma2         -> Gemma / Gemma2ForCausalLM
    Glm5NextForConditionalGeneration     glm5_next_text         -> Glm5NextTextForCausalLM
    Dots3NoteForConditionalGeneration    dots3_note_text        -> Dots3NoteForCausalLM
    Glm4vForConditionalGeneration,       glm4v_text             -> Glm4ForCausalLM
      Glm46VForConditionalGeneration
    Glm4vMoeForConditionalGeneration     glm4v_moe_text         -> Glm4MoeForCausalLM
    GlmOcrForConditionalGeneration       glm_ocr_text           -> Glm4ForCausalLM
    GraniteSpeechForConditionalGeneration  granite             -> GraniteForCausalLM
    GraniteSpeechPlusForConditionalGeneration  granite         -> GraniteForCausalLM
    Granite4VisionForConditionalGeneration  granite4_vision_text -> GraniteForCausalLM
    GraniteDoclingForConditionalGeneration  granite_docling_text -> GraniteForCausalLM
    MuseSparkForConditionalGeneration    muse_spark_text        -> MuseSparkTextForCausalLM
    MuseGlimmerForConditionalGeneration  muse_glimmer_text      -> MuseGlimmerTextForCausalLM
    HunYuanVLForConditionalGeneration    hunyuan_vl_text        -> HunYuanVLTextForCausalLM
    Idefics2ForConditionalGeneration     mistral                -> MistralForCausalLM
    Idefics3ForConditionalGeneration,    llama                  -> LlamaForCausalLM
      SmolVLMForConditionalGeneration
    InklingForConditionalGeneration      inkling_text           -> InklingForCausalLM
    Inkling2ForConditionalGeneration     inkling2_text          -> Inkling2ForCausalLM
    Inkling2LoopForConditionalGeneration  inkling2_loop_text    -> Inkling2LoopForCausalLM
    InternVLForConditionalGeneration     any (`any_text`)       -> its registered *ForCausalLM
      (released: qwen2, qwen3, qwen3_moe, llama, gpt_oss)
    InternS1ForConditionalGeneration     qwen3_moe / qwen3      -> Qwen3Moe / Qwen3ForCausalLM
    QianfanOCRForConditionalGeneration   qwen3 / qwen2          -> Qwen3 / Qwen2ForCausalLM
    InternVLChatModel (llm_config)       qwen2 / qwen3 / llama  -> Qwen2 / Qwen3 / Llama
                                         qwen3_moe / internlm2  -> Qwen3Moe / InternLM2
    SkyworkR1VChatModel (llm_config)     qwen2 / qwen3 / llama  -> Qwen2 / Qwen3 / Llama
    H2OVLChatModel (llm_config)          mistral / llama        -> Mistral / Llama
    NVLM_D (llm_config)                  qwen2                  -> Qwen2ForCausalLM
    DeepseekOcr2ForConditionalGeneration  deepseek_ocr2_text    -> DeepseekOcr2TextForCausalLM
    DeepseekOCRForCausalLM (remote code)  deepseek_ocr2_text    -> DeepseekOcr2TextForCausalLM
      (DeepSeek-OCR v1's DeepSeek-V2 MHA decoder: models/deepseek_ocr_v1_config.py)
    DotsOCRForCausalLM (remote code)     qwen2                  -> Qwen2ForCausalLM
      (dots.ocr: models/dots_ocr_config.py; images multimodal/dots_ocr.py)
    OpenCUAForConditionalGeneration      qwen2                  -> Qwen2ForCausalLM
      (remote code: models/opencua_config.py; 1-D rope; images multimodal/opencua.py)
    IsaacForConditionalGeneration        qwen3                  -> Qwen3ForCausalLM
      (remote code: models/isaac_config.py; M-RoPE; images multimodal/isaac.py)
    KeyeForConditionalGeneration         qwen3                  -> Qwen3ForCausalLM
    KeyeVL1_5ForConditionalGeneration    qwen3                  -> Qwen3ForCausalLM
      (remote code: models/keye_config.py; M-RoPE; images multimodal/keye.py)
    Step3VLForConditionalGeneration      step3_text             -> Step3TextForCausalLM
      (remote code: models/step3_vl_config.py; images multimodal/step3_vl.py)
    DeepseekVLV2ForCausalLM (remote code) deepseek_ocr2_text   -> DeepseekOcr2TextForCausalLM
                                         deepseek_v2          -> DeepseekV2ForCausalLM
      (DeepSeek-VL2's decoder, MHA (tiny) or MLA: models/deepseek_vl2_config.py)
    Kimi_K25ForConditionalGeneration     deepseek_v3            -> DeepseekV3ForCausalLM
    KimiVLForConditionalGeneration       deepseek_v3            -> DeepseekV3ForCausalLM
    LightOnOcrForConditionalGeneration   qwen3                  -> Qwen3ForCausalLM
                                         any other (`any_text`) -> its registered *ForCausalLM
      LightOnOCRForConditionalGeneration (vLLM's name: models/hub_vlm_configs.py)
    Lfm2VlForConditionalGeneration       lfm2                   -> Lfm2ForCausalLM
                                         any other (`any_text`) -> its registered *ForCausalLM
    Lfm3VlForConditionalGeneration       lfm3                   -> Lfm3ForCausalLM
    Llama4ForConditionalGeneration       llama4_text            -> Llama4ForCausalLM
    LlavaForConditionalGeneration,       any (`any_text`)       -> its registered *ForCausalLM
      LlavaNextForConditionalGeneration, (released: llama, mistral, qwen2, qwen3, gemma,
      LlavaOnevisionForConditionalGeneration,                     phi3, granite)
      VipLlavaForConditionalGeneration,
      LlavaNextVideoForConditionalGeneration,
      TarsierForConditionalGeneration (Tarsier v1)
    LlavaOnevision15ForConditionalGeneration  qwen3            -> Qwen3ForCausalLM
    BeeForConditionalGeneration          qwen3                  -> Qwen3ForCausalLM
      (Bee-8B, remote code: models/bee_config.py; images multimodal/bee.py)
    Mistral3ForConditionalGeneration     mistral                -> MistralForCausalLM
                                         ministral3             -> Ministral3ForCausalLM
                                         mistral4               -> Mistral4ForCausalLM
                                         any other (`any_text`) -> its registered *ForCausalLM
    MistralLarge4ForConditionalGeneration  mistral_large4_text  -> MistralLarge4TextForCausalLM
    MiniCPMV4_6ForConditionalGeneration, qwen3_5_text           -> Qwen3_5ForCausalLM
      MiniCPMV4_7ForConditionalGeneration
    MiniCPMOcrForConditionalGeneration   qwen3_5_text           -> Qwen3_5ForCausalLM
    MiniCPMV (remote code)               llama / qwen2 / qwen3  -> Llama / Qwen2 / Qwen3ForCausalLM
      (MiniCPM-V 2.5 / 2.6 / 4.0 / 4.5 under `llm.`: models/minicpmv_remote_config.py)
    MiniCPMO (remote code)               qwen2                  -> Qwen2ForCausalLM
      (MiniCPM-o 2.6 under `llm.`: models/minicpmo_remote_config.py; `tts.` skipped)
    MiDashengLMModel (remote code)       qwen2                  -> Qwen2ForCausalLM
      (MiDashengLM under `decoder.`: models/midashenglm_config.py; audio multimodal/midashenglm.py)
    MoonshotKimiaForCausalLM (remote code)  qwen2               -> Qwen2ForCausalLM
      (Kimi-Audio, flat Qwen2 names: models/kimi_audio_config.py; audio multimodal/kimi_audio.py)
    QwenVLForConditionalGeneration       (flat) qwen            -> QWenLMHeadModel
      (Qwen-VL v1, remote code: models/qwen_vl_v1_config.py)
    GLM4VForCausalLM                     (flat) chatglm         -> ChatGLMForCausalLM
      (GLM-4V 9B, remote code: models/glm4v_remote_config.py)
    NemotronH_Omni_Reasoning_V3          nemotron_h             -> NemotronHForCausalLM
    NemotronH_Nano_VL_V2 (remote code)   nemotron_h             -> NemotronHForCausalLM
      (models/nemotron_nano_vl_config.py)
    Llama_Nemotron_Nano_VL (remote code) llama                  -> LlamaForCausalLM
      (models/nemotron_vl_v1_config.py)
    Molmo2ForConditionalGeneration       molmo2_text            -> Molmo2TextForCausalLM
    MolmoForCausalLM (remote code)       qwen2 / olmo2          -> MolmoV1TextForCausalLM
      (Molmo v1's Qwen2 / OLMo 2 decoder, fused names: models/molmo_v1.py, molmo_v1_config.py)
                                         olmoe                  -> MolmoeTextForCausalLM
      (MolmoE-1B's OLMoE decoder, megablocks names: models/molmoe.py, molmoe_config.py)
    Ovis2_5ForConditionalGeneration      qwen3                  -> Qwen3ForCausalLM
    Ovis2_5 (remote code)                qwen3                  -> Qwen3ForCausalLM
    Ovis2ForConditionalGeneration        qwen2                  -> Qwen2ForCausalLM
    Phi4MultimodalForCausalLM            (flat) phi4_multimodal -> Phi3ForCausalLM
    Phi3VForCausalLM                     (flat) phi3_v          -> Phi3ForCausalLM
    Phi4MMForCausalLM (remote code)      (flat) phi4_multimodal -> Phi3ForCausalLM
    PaddleOCRVLForConditionalGeneration  paddleocr_vl_text      -> PaddleOCRTextForCausalLM
    Ernie4_5_VLMoeForConditionalGeneration  ernie4_5_vl_moe_text -> Ernie4_5_VLMoeTextForCausalLM
    Qwen2_5OmniThinkerForConditional..., qwen2_5_omni_text      -> Qwen2ForCausalLM
      Qwen2_5OmniForConditionalGeneration (thinker_config.text_config)
    Qwen3OmniMoeThinkerForConditional..., qwen3_omni_moe_text   -> Qwen3MoeForCausalLM
      Qwen3OmniMoeForConditionalGeneration (thinker_config.text_config)
    Qwen2AudioForConditionalGeneration   qwen2                  -> Qwen2ForCausalLM
    AudioFlamingo3ForConditionalGeneration  qwen2               -> Qwen2ForCausalLM
    GlmAsrForConditionalGeneration       llama                  -> LlamaForCausalLM
    Qwen3ASRForConditionalGeneration     qwen3                  -> Qwen3ForCausalLM
    FunAsrNanoForConditionalGeneration   qwen3                  -> Qwen3ForCausalLM
    MusicFlamingoForConditionalGeneration  qwen2                -> Qwen2ForCausalLM
    VoxtralForConditionalGeneration      llama / mistral        -> Llama / MistralForCausalLM
                                         any other (`any_text`) -> its registered *ForCausalLM
    VoxtralRealtimeForConditionalGeneration  voxtral_realtime_text -> VoxtralRealtimeTextForCausalLM
    Qwen2VLForConditionalGeneration      qwen2_vl_text          -> Qwen2ForCausalLM
    Qwen2_5_VLForConditionalGeneration   qwen2_5_vl_text        -> Qwen2ForCausalLM
    JinaVLForRanking (remote code)       qwen2_vl_text          -> JinaVLForSequenceClassification
    Tarsier2ForConditionalGeneration     qwen2_vl_text          -> Qwen2ForCausalLM
    Qwen3VLForConditionalGeneration      qwen3_vl_text          -> Qwen3ForCausalLM
    Qwen3VLMoeForConditionalGeneration   qwen3_vl_moe_text      -> Qwen3MoeForCausalLM
    Qwen3_5ForConditionalGeneration      qwen3_5_text           -> Qwen3_5ForCausalLM
    Qwen3_5MoeForConditionalGeneration   qwen3_5_moe_text       -> Qwen3_5MoeForCausalLM
    Qwen4ExpForConditionalGeneration     qwen4_exp_text         -> Qwen4ExpForCausalLM
    MiniMaxM3SparseForConditionalGeneration  minimax_m3_vl_text -> MiniMaxM3VLForCausalLM
    MiniMaxVL01ForConditionalGeneration  minimax_text_01        -> MiniMaxText01ForCausalLM
      (remote code: models/minimax_vl_01_config.py; images multimodal/minimax_vl_01.py)
    Step3p7ForConditionalGeneration      step3p5                -> Step3p7TextForCausalLM
    HYV4VLForConditionalGeneration       hy_v4_vl_text          -> HYV4VLTextForCausalLM
    Cosmos3EdgeForConditionalGeneration  cosmos3_edge_text      -> Cosmos3EdgeTextForCausalLM
    PerceptionLMForConditionalGeneration  llama                 -> LlamaForCausalLM
    FastVlmForConditionalGeneration      qwen2                  -> Qwen2ForCausalLM
    UltravoxModel                        llama                  -> LlamaForCausalLM
    EmbeddingGemma2Model                 embedding_gemma2_text  -> EmbeddingGemma2TextModel
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def _modules(*names: str) -> tuple[str, ...]:
    """Weight-name prefixes of a wrapper's non-text modules, at the top level and under
    `model.` (transformers 5 and older saves differ)."""
    return tuple(f"{prefix}{name}." for prefix in ("", "model.") for name in names)


_LLAVA_STYLE = _modules("vision_tower", "multi_modal_projector")
_AUDIO_STYLE = _modules("audio_tower", "multi_modal_projector")
_QWEN_VISUAL = _modules("visual")
# LLaVA-NeXT: also its image_newline parameter (a name of its own, no dot after it)
_LLAVA_NEXT = (*_LLAVA_STYLE, "image_newline", "model.image_newline")
_IDEFICS3 = _modules("vision_model", "connector")
# Gemma 4: vision and audio towers and their embedders into the text space
_GEMMA4_TOWERS = _modules("vision_tower", "audio_tower", "embed_vision", "embed_audio")
# Gemma 4 Unified is encoder-free: transformers saves its vision embedder's patch / position
# parts as `vision_embedder.` beside `embed_vision.` / `embed_audio.`
_GEMMA4_UNIFIED_EMBEDDERS = _modules("vision_embedder", "embed_vision", "embed_audio")
# Gemma 3n: the towers (their token embedders load: see `media_embedders`)
_GEMMA3N_TOWERS = _modules("vision_tower", "audio_tower")
_LLAMA4_VISION = _modules("vision_model", "multi_modal_projector")
_KIMI_K25 = _modules("vision_tower", "mm_projector")
# transformers 5 saves Kimi K2.5 with its vision tower's `blocks` <- `layers` rename applied
# to the decoder's layers too (and loads them back through it)
_KIMI_K25_RENAMES = (
    ("language_model.model.blocks.", "model.layers."),
    ("model.language_model.blocks.", "model.layers."),
)
_MINICPMV = _modules("vision_tower", "merger")
_HUNYUAN_VL = _modules("vision_tower", "vit")  # transformers 5's, the Hub's
_PADDLEOCR_VL = (*_modules("visual", "projector"), "mlp_AR.")  # the Hub's projector: mlp_AR
_ERNIE4_5_VL = _modules("vision_model", "vision_tower", "resampler_model")  # Hub's, transformers'
# Ovis 2.5: transformers 5's names, and the Hub's visual tokenizer and its embedding table
_OVIS2_5 = (*_LLAVA_STYLE, "visual_tokenizer.", "vte.", "model.vte.")
# Ovis 2.5's Hub checkpoints keep the language model under `llm.`
_OVIS2_5_RENAMES = (("llm.model.", "model."), ("llm.lm_head.", "lm_head."))
# Ovis2 (transformers' port): the AIMv2 tower and visual tokenizer, the visual embedding table
_OVIS2 = _modules("vision_tower", "visual_embeddings_table")
# Apertus 1.5: the image and audio tokenizers (their codes embed with the text table)
_APERTUS1P5_TOKENIZERS = _modules("vision_tokenizer", "audio_tokenizer")
# Muse Spark / Glimmer: the tower, its adapter and projection (`perception_emb_norm` has no
# weights)
_MUSE_TOWERS = _modules("vision_tower", "vision_adapter", "vision_projection")

# GLM-4.1V / 4.5V / 4.6V: a Qwen2-VL-style tower under `visual`
_GLM4V_TEXT = {"glm4v_text": "Glm4ForCausalLM"}
# Qwen Omni: the thinker's towers, and the talker / vocoder of the whole model (speech output)
_OMNI_TOWERS = (
    *_modules("visual", "audio_tower"),
    *(f"thinker.{p}" for p in _modules("visual", "audio_tower")),
    "talker.",
    "token2wav.",  # Qwen2.5-Omni
    "code2wav.",  # Qwen3-Omni
)
# the whole model's thinker: `thinker.model.[language_model.]X` -> `model.X`
_OMNI_RENAMES = (
    ("thinker.model.language_model.", "model."),
    ("thinker.model.", "model."),
    ("thinker.lm_head.", "lm_head."),
)
_QWEN2_5_OMNI_TEXT = {"qwen2_5_omni_text": "Qwen2ForCausalLM"}
_QWEN3_OMNI_TEXT = {"qwen3_omni_moe_text": "Qwen3MoeForCausalLM"}
# Qwen3-Omni's thinker attention drops sliding_window, while transformers' cache, built from
# the same config, keeps only the window: a set window has no one meaning (the Hub's is null)
_QWEN3_OMNI_REFUSED = ("sliding_window",)


@dataclass(frozen=True, slots=True)
class Wrapper:
    text_archs: dict[str, str]  # text_config.model_type -> our text *ForCausalLM
    skipped: tuple[str, ...]  # name prefixes of the vision weights
    no_final_soft_cap: bool = False  # the wrapper's logits are lm_head(hidden) alone
    mrope: bool = False  # the text rope is M-RoPE: the ordinary rope on text-only input
    renormalized_topk: bool = False  # the router renormalizes whatever norm_topk_prob says
    hub_experts: bool = False  # fused experts may come transposed ([E, H, 2I], [E, I, H])
    # (sub-config, module): towers whose token ids the wrapper embeds with that module
    media_embedders: tuple[tuple[str, str], ...] = ()
    no_logit_scale: bool = False  # the wrapper's logits are lm_head alone, unscaled
    # (checkpoint prefix, our prefix) of the wrapper's own naming, tried before `_RENAMES`
    renames: tuple[tuple[str, str], ...] = ()
    # (field, value): what the wrapper's text model hard-codes, whatever text_config says
    fixed: tuple[tuple[str, Any], ...] = ()
    # text_config fields that must be unset (None) to be served
    refused: tuple[str, ...] = ()
    # the text model's attention takes head_dim = hidden_size // num_attention_heads
    head_dim_from_heads: bool = False
    # the sub-config that holds text_config and the flags (Qwen Omni's `thinker_config`)
    sub_config: str | None = None
    # the token table holds text_config.additional_vocab_size ids past vocab_size that the head
    # never scores (Molmo2's image tokens): the copy's vocab_size counts them, its
    # `head_vocab_size` is the head's
    extra_vocab: bool = False
    # the wrapper's config is its text model's (no text_config: Phi-4-multimodal)
    flat: bool = False
    # top-level fields the copy keeps (ERNIE 4.5 VL's vision token ids: its expert routing)
    carried: tuple[str, ...] = ()
    # the release's remote names (PEFT `base_layer`s, adapters beside: Phi4MMForCausalLM)
    # mapped by multimodal/phi4mm_remote.py's hf_weights
    remote_phi4mm: bool = False
    # the wrapper holds a whole *ForCausalLM built from text_config (transformers' BLIP-2,
    # Llama 4): text_config's tie_word_embeddings ties its head, the top-level flag is
    # never read (multimodal_text.py's `wrapper_ties_head`)
    nested_head: bool = False
    # the wrapper builds its text model from text_config whatever its model_type (transformers'
    # AutoModel, vLLM's init_vllm_registered_model): a type `text_archs` lacks is served by
    # the registered class of transformers' causal LM for it (multimodal_text.py's
    # `registered_text_arch`), with that class's own logits rules
    any_text: bool = False


WRAPPERS: dict[str, Wrapper] = {
    # Apertus 1.5: lm_head(text model) as Apertus1p5TextForCausalLM, pruned alike
    # Phi-4-multimodal: Phi-3's decoder, its fields at the config's top level; the image and
    # audio embedders under `model.embed_tokens_extend.` (multimodal/phi4mm.py, phi4mm_audio.py)
    "Phi4MultimodalForCausalLM": Wrapper(
        {"phi4_multimodal": "Phi3ForCausalLM"}, _modules("embed_tokens_extend"), flat=True
    ),
    # Chameleon: its decoder's fields at the config's top level, its VQ-VAE under
    # `model.vqmodel.` (images: multimodal/chameleon.py; the decoder: models/chameleon.py)
    "ChameleonForConditionalGeneration": Wrapper(
        {"chameleon": "ChameleonForCausalLM"}, _modules("vqmodel"), flat=True
    ),
    # Emu3: Llama (models/__init__.py's Emu3ForCausalLM) and its VQ-VAE (images:
    # multimodal/emu3.py); the Hub's and transformers 5's saves name them `text_model.model.`,
    # `text_model.lm_head.` and `vqmodel.` (loaded as `model.text_model.` ...: _RENAMES)
    "Emu3ForConditionalGeneration": Wrapper(
        {"emu3_text_model": "Emu3ForCausalLM"},
        _modules("vqmodel"),
        renames=(("text_model.model.", "model."), ("text_model.lm_head.", "lm_head.")),
    ),
    "Apertus1p5ForConditionalGeneration": Wrapper(
        {"apertus1p5_text": "Apertus1p5TextForCausalLM"}, _APERTUS1P5_TOKENIZERS
    ),
    # Aria: an Idefics3-style tower and a cross-attention projector (images: multimodal/aria.py)
    # into its MoE decoder (models/aria.py)
    "AriaForConditionalGeneration": Wrapper({"aria_text": "AriaTextForCausalLM"}, _LLAVA_STYLE),
    # PaliGemma / 2: the wrapper sets use_bidirectional_attention for its prompt prefix's mask
    # (multimodal/paligemma.py); its positions count from 1, a shift RoPE does not see
    "PaliGemmaForConditionalGeneration": Wrapper(
        {"gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM"},
        _LLAVA_STYLE,
        fixed=(("use_bidirectional_attention", False),),
    ),
    "Gemma3ForConditionalGeneration": Wrapper(
        {"gemma3_text": "Gemma3ForCausalLM"}, _LLAVA_STYLE, no_final_soft_cap=True
    ),
    # Aya Vision multiplies lm_head's logits by text_config.logit_scale as Cohere's models do;
    # Command A Vision's wrapper does not (the copy's logit_scale is 1)
    "AyaVisionForConditionalGeneration": Wrapper(
        {"cohere2": "Cohere2ForCausalLM", "cohere": "CohereForCausalLM"}, _LLAVA_STYLE
    ),
    # (transformers' AutoModel and vLLM's text_config.architectures: any text model, the
    # logit_scale rule kept)
    "Cohere2VisionForConditionalGeneration": Wrapper(
        {"cohere2": "Cohere2ForCausalLM"}, _LLAVA_STYLE, no_logit_scale=True, any_text=True
    ),
    # Cohere Compass (North-Micro-Vision): a Qwen3-VL tower under `visual` (images:
    # multimodal/qwen2_vl.py) into its Cohere decoder (models/cohere_compass.py); logits
    # times text_config.logit_scale (None: 1) as the text model's
    "CohereCompassForConditionalGeneration": Wrapper(
        {"cohere_compass_text": "CohereCompassForCausalLM"}, _QWEN_VISUAL
    ),
    # EXAONE 4.5: a Qwen2.5-VL-style tower (images: multimodal/exaone4_5.py); text positions
    # are the plain 1-D ones; its multi-token-prediction head (`mtp.*`, which transformers
    # ignores at load) is not served
    "Exaone4_5_ForConditionalGeneration": Wrapper(
        {"exaone4": "Exaone4ForCausalLM"}, (*_QWEN_VISUAL, *_modules("mtp"))
    ),
    # GLM-4.1V / 4.6V's decoder is GLM-4's (interleaved partial rope, four norms a layer) with
    # q / k / v biases always and head_dim from the heads; GLM-4.5V's is GLM-4.5's (NeoX
    # partial rope, no q / k norms whatever use_qk_norm says)
    "Glm4vForConditionalGeneration": Wrapper(
        _GLM4V_TEXT,
        _QWEN_VISUAL,
        mrope=True,
        fixed=(("attention_bias", True),),
        head_dim_from_heads=True,
    ),
    "Glm46VForConditionalGeneration": Wrapper(
        _GLM4V_TEXT,
        _QWEN_VISUAL,
        mrope=True,
        fixed=(("attention_bias", True),),
        head_dim_from_heads=True,
    ),
    # GLM-OCR: GLM-4.1V's decoder without q / k / v biases, text_config.head_dim as given
    "GlmOcrForConditionalGeneration": Wrapper(
        {"glm_ocr_text": "Glm4ForCausalLM"},
        _QWEN_VISUAL,
        mrope=True,
        fixed=(("attention_bias", False),),
    ),
    "Glm4vMoeForConditionalGeneration": Wrapper(
        {"glm4v_moe_text": "Glm4MoeForCausalLM"},
        _QWEN_VISUAL,
        mrope=True,
        fixed=(("use_qk_norm", False),),
    ),
    # HunyuanOCR: Hunyuan's dense decoder; its "xdrope" rope is the dynamic-alpha one over
    # M-RoPE axes (models/hunyuan_vl.py), one position on all of them for text
    "HunYuanVLForConditionalGeneration": Wrapper(
        {"hunyuan_vl_text": "HunYuanVLTextForCausalLM"}, _HUNYUAN_VL
    ),
    "Idefics2ForConditionalGeneration": Wrapper({"mistral": "MistralForCausalLM"}, _IDEFICS3),
    # PaddleOCR-VL: ERNIE 4.5's decoder with NeoX-halves M-RoPE (models/paddleocr_vl.py)
    "PaddleOCRVLForConditionalGeneration": Wrapper(
        {"paddleocr_vl_text": "PaddleOCRTextForCausalLM"}, _PADDLEOCR_VL, mrope=True
    ),
    # ERNIE 4.5 VL: ERNIE 4.5 MoE with text / vision experts chosen by token and a 3-D rope
    # (models/ernie4_5_vl_moe.py); the vision token ids go with the copy for the routing
    "Ernie4_5_VLMoeForConditionalGeneration": Wrapper(
        {"ernie4_5_vl_moe_text": "Ernie4_5_VLMoeTextForCausalLM"},
        _ERNIE4_5_VL,
        carried=(
            "image_token_id",
            "image_start_token_id",
            "image_end_token_id",
            "video_token_id",
            "video_start_token_id",
            "video_end_token_id",
        ),
    ),
    # Kimi K2.5 / K2.6: a DeepSeek-V3 decoder (text_config "kimi_k2" reads as deepseek_v3)
    "Kimi_K25ForConditionalGeneration": Wrapper(
        {"deepseek_v3": "DeepseekV3ForCausalLM"}, _KIMI_K25, renames=_KIMI_K25_RENAMES
    ),
    # Kimi-VL (remote code; config: models/kimi_vl_config.py): the Hub's DeepSeek-V3 names
    "KimiVLForConditionalGeneration": Wrapper(
        {"deepseek_v3": "DeepseekV3ForCausalLM"}, _modules("vision_tower", "multi_modal_projector")
    ),
    "Lfm3VlForConditionalGeneration": Wrapper({"lfm3": "Lfm3ForCausalLM"}, _LLAVA_STYLE),
    # MiniCPM-V 4.6 / 4.7: Qwen3.5's hybrid decoder, M-RoPE plain on text
    "MiniCPMV4_6ForConditionalGeneration": Wrapper(
        {"qwen3_5_text": "Qwen3_5ForCausalLM"}, _MINICPMV, mrope=True
    ),
    "MiniCPMV4_7ForConditionalGeneration": Wrapper(
        {"qwen3_5_text": "Qwen3_5ForCausalLM"}, _MINICPMV, mrope=True
    ),
    "Ovis2_5ForConditionalGeneration": Wrapper(
        {"qwen3": "Qwen3ForCausalLM"}, _OVIS2_5, renames=_OVIS2_5_RENAMES
    ),
    "Ovis2ForConditionalGeneration": Wrapper({"qwen2": "Qwen2ForCausalLM"}, _OVIS2),
    # Ovis2.5's Hub release (remote code; config: models/ovis2_5_hub.py): the port's names
    "Ovis2_5": Wrapper({"qwen3": "Qwen3ForCausalLM"}, _OVIS2_5, renames=_OVIS2_5_RENAMES),
    # Gemma 4's wrapper soft-caps its logits as the text model does; on text it computes the
    # per-layer inputs from the token ids as the text model does.
    "Gemma4ForConditionalGeneration": Wrapper({"gemma4_text": "Gemma4ForCausalLM"}, _GEMMA4_TOWERS),
    "Gemma4UnifiedForConditionalGeneration": Wrapper(
        {"gemma4_unified_text": "Gemma4UnifiedForCausalLM"}, _GEMMA4_UNIFIED_EMBEDDERS
    ),
    # GLM-5.3-Flash: its vision tower under `model.visual.`, as Qwen's
    "Glm5NextForConditionalGeneration": Wrapper(
        {"glm5_next_text": "Glm5NextTextForCausalLM"}, _QWEN_VISUAL
    ),
    # dots3 note: vision and audio towers (transformers' names; the Hub's `vision_encoder.`,
    # `audio_encoder.`, `audio_adapter.` at the top level) into its MLA / DSA decoder
    # (models/dots3_note.py); the Hub's decoder is `model.layers.*` already
    "Dots3NoteForConditionalGeneration": Wrapper(
        {"dots3_note_text": "Dots3NoteForCausalLM"},
        _modules("vision_tower", "audio_tower", "vision_encoder", "audio_encoder", "audio_adapter"),
    ),
    # Gemma 3n soft-caps as its text model does; ids from the vision / audio offsets embed
    # through those towers' token embedders
    "Gemma3nForConditionalGeneration": Wrapper(
        {"gemma3n_text": "Gemma3nForCausalLM"},
        _GEMMA3N_TOWERS,
        media_embedders=(("vision_config", "embed_vision"), ("audio_config", "embed_audio")),
    ),
    "Llama4ForConditionalGeneration": Wrapper(
        {"llama4_text": "Llama4ForCausalLM"}, _LLAMA4_VISION, nested_head=True
    ),
    # LLaVA 1.5 / NeXT, Pixtral-12B's HF form (a Mistral decoder), LLaVA-OneVision-style Qwen2;
    # released around Llama, Mistral, Qwen2 / 3, Gemma (Intel/llava-gemma-*), Phi-3
    # (xtuner/llava-phi-3-mini-hf), Granite (granite-vision-3.x: its logits_scaling kept, as
    # vLLM and transformers 4, whose wrapper held a whole GraniteForCausalLM; transformers 5's
    # wrapper head drops it, which moves logprobs, not greedy tokens): any text model
    "LlavaForConditionalGeneration": Wrapper({}, _LLAVA_STYLE, any_text=True),
    "LlavaNextForConditionalGeneration": Wrapper({}, _LLAVA_NEXT, any_text=True),
    "LlavaOnevisionForConditionalGeneration": Wrapper({}, _LLAVA_NEXT, any_text=True),
    # Bee-8B: LLaVA-OneVision's names (its projector's pre_norm dropped with it), Qwen3
    "BeeForConditionalGeneration": Wrapper({"qwen3": "Qwen3ForCausalLM"}, _LLAVA_NEXT),
    # ViP-LLaVA (a normed projector), LLaVA-NeXT-Video (its pooler has no weights: average / max)
    "VipLlavaForConditionalGeneration": Wrapper({}, _LLAVA_STYLE, any_text=True),
    "LlavaNextVideoForConditionalGeneration": Wrapper({}, _LLAVA_NEXT, any_text=True),
    # Tarsier v1: LLaVA 1.5's names (its separator rows: multimodal/tarsier.py)
    "TarsierForConditionalGeneration": Wrapper({}, _LLAVA_STYLE, any_text=True),
    # LLaVA-OneVision-1.5: RICE-ViT under `visual` (images: multimodal/llava_onevision1_5.py),
    # 1-D text positions; transformers 5.25 saves the decoder as `model.model.X`
    "LlavaOnevision15ForConditionalGeneration": Wrapper(
        {"qwen3": "Qwen3ForCausalLM"}, _QWEN_VISUAL, renames=(("model.model.", "model."),)
    ),
    # Idefics3, SmolVLM / SmolVLM2: a Llama decoder under `model.text_model`
    "Idefics3ForConditionalGeneration": Wrapper({"llama": "LlamaForCausalLM"}, _IDEFICS3),
    "SmolVLMForConditionalGeneration": Wrapper({"llama": "LlamaForCausalLM"}, _IDEFICS3),
    # InternVL3 / 3.5: released around Qwen2 / 3 (/ MoE), Llama and gpt-oss
    # (InternVL3_5-GPT-OSS-20B-A4B-Preview-HF): any text model
    "InternVLForConditionalGeneration": Wrapper({}, _LLAVA_STYLE, any_text=True),
    # Intern-S1 / Intern-S1-mini (config: models/hub_vlm_configs.py): InternVL's model and names
    "InternS1ForConditionalGeneration": Wrapper(
        {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen3": "Qwen3ForCausalLM"}, _LLAVA_STYLE
    ),
    # Qianfan-OCR: InternVL's wrapper, a Qwen3 decoder (images: multimodal/qianfan_ocr.py);
    # the Hub keeps InternVL-Chat's names (vision_model., mlp1., language_model.model.), which
    # transformers 5.25 saves back with the decoder's layers under `encoder.layers.`
    "QianfanOCRForConditionalGeneration": Wrapper(
        {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM"},
        (*_LLAVA_STYLE, "vision_model.", "mlp1."),
        renames=(("language_model.model.encoder.layers.", "model.layers."),),
    ),
    # DeepSeek-OCR-2: text only (its SAM + Qwen2 query tower does not run); the Hub's names
    # (sam_model, qwen2_model, projector, view_seperator) and transformers' both skipped
    "DeepseekOcr2ForConditionalGeneration": Wrapper(
        {"deepseek_ocr2_text": "DeepseekOcr2TextForCausalLM"},
        (
            *_LLAVA_STYLE,
            *_modules("sam_model", "qwen2_model", "projector"),
            *(f"{p}{n}" for p in ("", "model.") for n in ("view_seperator", "view_separator")),
        ),
    ),
    # DeepSeek-OCR v1 (remote code; config: models/deepseek_ocr_v1_config.py): the decoder
    # under `model.` as in DeepSeek-V2's release, the DeepEncoder beside it
    # (multimodal/deepseek_ocr_v1_encoder.py)
    "DeepseekOCRForCausalLM": Wrapper(
        {"deepseek_ocr2_text": "DeepseekOcr2TextForCausalLM"},
        _modules("sam_model", "vision_model", "projector")
        + ("model.image_newline", "model.view_seperator"),
    ),
    # dots.ocr (remote code; config: models/dots_ocr_config.py): Qwen2 under its own names
    # (`model.`, `lm_head.`), the NaViT tower `vision_tower.` beside it (multimodal/dots_ocr.py)
    "DotsOCRForCausalLM": Wrapper({"qwen2": "Qwen2ForCausalLM"}, ("vision_tower.",)),
    # OpenCUA (remote code; config: models/opencua_config.py): Qwen2 at 1-D positions under
    # `language_model.` (_RENAMES), Qwen2.5-VL's tower `vision_tower.` (multimodal/opencua.py)
    "OpenCUAForConditionalGeneration": Wrapper(
        {"qwen2": "Qwen2ForCausalLM"}, _modules("vision_tower", "visual")
    ),
    # Isaac (remote code; config: models/isaac_config.py): Qwen3 (M-RoPE) under Qwen3's own
    # names, the tower and projector `model.vision_embedding.` beside it (isaac_encoder.py)
    "IsaacForConditionalGeneration": Wrapper(
        {"qwen3": "Qwen3ForCausalLM"}, _modules("vision_embedding")
    ),
    # Keye-VL (remote code; config: models/keye_config.py): Qwen3 (M-RoPE) under its own names,
    # the tower `visual.` and projector `mlp_AR.` beside it (multimodal/paddleocr_vl.py)
    "KeyeForConditionalGeneration": Wrapper({"qwen3": "Qwen3ForCausalLM"}, _PADDLEOCR_VL),
    "KeyeVL1_5ForConditionalGeneration": Wrapper({"qwen3": "Qwen3ForCausalLM"}, _PADDLEOCR_VL),
    # Step3-VL (remote code; config: models/step3_vl_config.py): Step3's decoder under its own
    # names (`model.`, `lm_head.`), the ViT, downsamplers and projector beside (step3_vl_encoder.py)
    "Step3VLForConditionalGeneration": Wrapper(
        {"step3_text": "Step3TextForCausalLM"},
        ("vision_model.", "vit_downsampler.", "vit_downsampler2.", "vit_large_projector."),
    ),
    # MiniCPM-V 2.5 to 4.5 (remote code; config: models/minicpmv_remote_config.py): Llama /
    # Qwen2 / Qwen3 under `llm.`, the tower `vpm.` and the resampler beside it (minicpmv_remote.py)
    "MiniCPMV": Wrapper(
        {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"},
        ("vpm.", "resampler."),
        renames=(("llm.model.", "model."), ("llm.lm_head.", "lm_head.")),
    ),
    # MiniCPM-o 2.6 (remote code; config: models/minicpmo_remote_config.py): MiniCPM-V 2.6's
    # layout plus `apm.` / `audio_projection_layer.` (minicpmo_remote.py); `tts.` output-only
    "MiniCPMO": Wrapper(
        {"qwen2": "Qwen2ForCausalLM"},
        ("vpm.", "resampler.", "apm.", "audio_projection_layer.", "tts."),
        renames=(("llm.model.", "model."), ("llm.lm_head.", "lm_head.")),
    ),
    # MiDashengLM (remote code; config: models/midashenglm_config.py): Qwen2 under `decoder.`,
    # the Dasheng encoder and projector beside it (multimodal/midashenglm.py)
    "MiDashengLMModel": Wrapper(
        {"qwen2": "Qwen2ForCausalLM"},
        ("audio_encoder.", "audio_projector."),
        renames=(("decoder.model.", "model."), ("decoder.lm_head.", "lm_head.")),
    ),
    # Kimi-Audio (remote code; config: models/kimi_audio_config.py): Qwen2 under its own names
    # and lm_head (the text head, vLLM's); the adaptor (multimodal/kimi_audio.py) and the MIMO
    # audio-token branch beside it
    "MoonshotKimiaForCausalLM": Wrapper(
        {"qwen2": "Qwen2ForCausalLM"},
        ("model.vq_adaptor.", "model.mimo_layers.", "model.mimo_norm.", "mimo_output."),
    ),
    # Qwen-VL v1 (remote code; config: models/qwen_vl_v1_config.py): Qwen v1 under its own
    # `transformer.` names, the ViT and resampler under `transformer.visual.` (qwen_vl_v1.py)
    "QwenVLForConditionalGeneration": Wrapper(
        {"qwen": "QWenLMHeadModel"}, ("transformer.visual.",), flat=True
    ),
    # DeepSeek-VL2 (remote code; config: models/deepseek_vl2_config.py): the decoder under
    # `language.`, the tower and projector beside it (multimodal/deepseek_vl2_encoder.py)
    "DeepseekVLV2ForCausalLM": Wrapper(
        {
            "deepseek_ocr2_text": "DeepseekOcr2TextForCausalLM",
            "deepseek_v2": "DeepseekV2ForCausalLM",
        },
        ("vision.", "projector.", "image_newline", "view_seperator"),
        renames=(("language.model.", "model."), ("language.lm_head.", "lm_head.")),
    ),
    # LFM2-VL: released around LFM2; transformers (AutoModel) and vLLM (text_config's
    # architectures) build any text model
    "Lfm2VlForConditionalGeneration": Wrapper(
        {"lfm2": "Lfm2ForCausalLM"}, _LLAVA_STYLE, any_text=True
    ),
    # Molmo2: a Qwen3-style decoder with a wider token table (images: multimodal/molmo2.py)
    "Molmo2ForConditionalGeneration": Wrapper(
        {"molmo2_text": "Molmo2TextForCausalLM"},
        (*_LLAVA_STYLE, *_modules("vision_backbone")),
        extra_vocab=True,
    ),
    # Molmo v1 (remote code; config: models/molmo_v1_config.py): Qwen2's decoder under the
    # release's fused names, Molmo2's wider table (images: multimodal/molmo_v1.py); MolmoE-1B:
    # OLMoE's decoder under the release's megablocks names (models/molmoe.py)
    "MolmoForCausalLM": Wrapper(
        {
            "qwen2": "MolmoV1TextForCausalLM",
            "olmo2": "MolmoV1TextForCausalLM",
            "olmoe": "MolmoeTextForCausalLM",
        },
        _modules("vision_backbone"),
        extra_vocab=True,
    ),
    # LightOnOCR: a Pixtral tower and Mistral 3's projector under their own names (images:
    # multimodal/lighton_ocr.py) into Qwen3; Mistral 3's wrapper in transformers and vLLM, so
    # any text model
    "LightOnOcrForConditionalGeneration": Wrapper(
        {"qwen3": "Qwen3ForCausalLM"},
        _modules("vision_encoder", "vision_projection"),
        any_text=True,
    ),
    # LightOnOCR-1B-1025's config.json name (vLLM's; models/hub_vlm_configs.py): the same
    "LightOnOCRForConditionalGeneration": Wrapper(
        {"qwen3": "Qwen3ForCausalLM"},
        _modules("vision_encoder", "vision_projection"),
        any_text=True,
    ),
    # DeepSeek-VL: SigLIP and an MLP aligner (images: multimodal/deepseek_vl.py) into Llama
    "DeepseekVLForConditionalGeneration": Wrapper(
        {"llama": "LlamaForCausalLM"}, _modules("vision_model", "aligner")
    ),
    # DeepSeek-VL hybrid: also a SAM high-resolution tower, its neck and projection, and the
    # scalar `high_res_vision_alpha` (a parameter: no dot after its name)
    "DeepseekVLHybridForConditionalGeneration": Wrapper(
        {"llama": "LlamaForCausalLM"},
        (
            *_modules("vision_model", "aligner", "high_res_vision_model"),
            *_modules("high_res_vision_neck", "high_res_vision_proj"),
            "high_res_vision_alpha",
            "model.high_res_vision_alpha",
        ),
    ),
    # Janus: SigLIP-style tower and aligner (images: multimodal/janus.py) into Llama; the image
    # generation half (VQ-VAE, generation embeddings / aligner / head) never loaded
    "JanusForConditionalGeneration": Wrapper(
        {"llama": "LlamaForCausalLM"},
        _modules("vision_model", "aligner", "vqmodel", "generation_embeddings")
        + _modules("generation_aligner", "generation_head"),
    ),
    # HyperCLOVA X Vision V2: Qwen2.5-VL's tower and a linear projector (images:
    # multimodal/hyperclovax_vision_v2.py); the Hub's release keeps the text model under
    # `model.language_model.model.` / `model.language_model.lm_head.`
    "HyperCLOVAXVisionV2ForConditionalGeneration": Wrapper(
        {"hyperclovax": "HyperCLOVAXForCausalLM"},
        _modules("vision_model", "vision_projector", "projector"),
        renames=(
            ("model.language_model.model.", "model."),
            ("model.language_model.lm_head.", "lm_head."),
        ),
    ),
    # HyperCLOVA X SEED Vision v1 (remote code; config: models/hcx_vision_v1_config.py): a
    # SigLIP tower, its projector and `image_newline` dropped (images are not served), the text
    # model at `language_model.` (_RENAMES), its head tied by text_config alone
    "HCXVisionForCausalLM": Wrapper(
        {"llama": "LlamaForCausalLM", "hyperclovax": "HyperCLOVAXForCausalLM"},
        (*_modules("vision_model", "mm_projector"), "image_newline"),
        nested_head=True,
    ),
    # Mistral Small 3.x / 4, Ministral 3 (their released text models); transformers'
    # (AutoModel) and vLLM's (init_vllm_registered_model) wrappers build any text model
    "Mistral3ForConditionalGeneration": Wrapper(
        {
            "mistral": "MistralForCausalLM",
            "ministral3": "Ministral3ForCausalLM",
            "mistral4": "Mistral4ForCausalLM",  # Mistral Small 4
        },
        _LLAVA_STYLE,
        any_text=True,
    ),
    # Mistral Large 4: transformers saves Mistral's native names (the text class maps them)
    "MistralLarge4ForConditionalGeneration": Wrapper(
        {"mistral_large4_text": "MistralLarge4TextForCausalLM"},
        (
            *_LLAVA_STYLE,
            "vision_encoder.",
            "patch_merger.",
            "pre_mm_projector_norm.",
            "vision_language_adapter.",
        ),
    ),
    # Qwen2.5-Omni / Qwen3-Omni: the thinker's language model, alone or inside the whole model
    # (the talker and vocoder, which speak the thinker's answer, dropped)
    "Qwen2_5OmniThinkerForConditionalGeneration": Wrapper(
        _QWEN2_5_OMNI_TEXT, _OMNI_TOWERS, mrope=True, renames=_OMNI_RENAMES
    ),
    "Qwen2_5OmniForConditionalGeneration": Wrapper(
        _QWEN2_5_OMNI_TEXT,
        _OMNI_TOWERS,
        mrope=True,
        renames=_OMNI_RENAMES,
        sub_config="thinker_config",
    ),
    "Qwen3OmniMoeThinkerForConditionalGeneration": Wrapper(
        _QWEN3_OMNI_TEXT,
        _OMNI_TOWERS,
        mrope=True,
        renames=_OMNI_RENAMES,
        refused=_QWEN3_OMNI_REFUSED,
    ),
    "Qwen3OmniMoeForConditionalGeneration": Wrapper(
        _QWEN3_OMNI_TEXT,
        _OMNI_TOWERS,
        mrope=True,
        renames=_OMNI_RENAMES,
        refused=_QWEN3_OMNI_REFUSED,
        sub_config="thinker_config",
    ),
    # Granite Speech: a conformer and a Q-Former into Granite (multimodal/granite_speech.py);
    # its logits are its own lm_head's, not divided by text_config.logits_scaling
    "GraniteSpeechForConditionalGeneration": Wrapper(
        {"granite": "GraniteForCausalLM"},
        _modules("encoder", "projector"),
        fixed=(("logits_scaling", 1.0),),
    ),
    # Granite Speech Plus: the same, its projector reading some conformer blocks' outputs too
    "GraniteSpeechPlusForConditionalGeneration": Wrapper(
        {"granite": "GraniteForCausalLM"},
        _modules("encoder", "projector"),
        fixed=(("logits_scaling", 1.0),),
    ),
    # Granite 4 Vision: a LLaVA-NeXT tower, deepstack / spatial Q-Former projectors (their
    # features only reach image positions) into Granite's decoder; logits / logits_scaling
    "Granite4VisionForConditionalGeneration": Wrapper(
        {"granite4_vision_text": "GraniteForCausalLM"},
        (*_LLAVA_NEXT, *_modules("layerwise_projectors", "spatial_projectors")),
    ),
    # Granite Docling: a SigLIP-style tower with its connector and density router into
    # Granite's dense decoder under `model.text_model.`; logits / logits_scaling
    "GraniteDoclingForConditionalGeneration": Wrapper(
        {"granite_docling_text": "GraniteForCausalLM"}, _modules("vision_model", "density_router")
    ),
    # Muse Spark / Glimmer (models/muse.py): their image / video (/ audio) placeholder ids
    # embed as id 0 whatever the prompt, so the ids go with the copy
    "MuseSparkForConditionalGeneration": Wrapper(
        {"muse_spark_text": "MuseSparkTextForCausalLM"},
        (*_MUSE_TOWERS, *_modules("audio_tower")),
        carried=("image_token_id", "video_token_id", "audio_token_id"),
    ),
    "MuseGlimmerForConditionalGeneration": Wrapper(
        {"muse_glimmer_text": "MuseGlimmerTextForCausalLM"},
        _MUSE_TOWERS,
        carried=("image_token_id", "video_token_id"),
    ),
    # Qwen2-Audio: Whisper's encoder into Qwen2 (audio: multimodal/qwen2_audio.py)
    "Qwen2AudioForConditionalGeneration": Wrapper({"qwen2": "Qwen2ForCausalLM"}, _AUDIO_STYLE),
    # Audio / Music Flamingo, GLM-ASR: Whisper-style towers (audio: multimodal/
    # audioflamingo3.py, musicflamingo.py, glmasr.py) into Qwen2 / Llama
    "AudioFlamingo3ForConditionalGeneration": Wrapper({"qwen2": "Qwen2ForCausalLM"}, _AUDIO_STYLE),
    "MusicFlamingoForConditionalGeneration": Wrapper({"qwen2": "Qwen2ForCausalLM"}, _AUDIO_STYLE),
    "GlmAsrForConditionalGeneration": Wrapper({"llama": "LlamaForCausalLM"}, _AUDIO_STYLE),
    # Qwen3-ASR: Qwen3-Omni's audio tower into Qwen3 (audio: multimodal/qwen3_asr.py)
    "Qwen3ASRForConditionalGeneration": Wrapper({"qwen3": "Qwen3ForCausalLM"}, _AUDIO_STYLE),
    # Fun-ASR-Nano: a SAN-M encoder and an adaptor into Qwen3 (multimodal/fun_asr_nano.py)
    "FunAsrNanoForConditionalGeneration": Wrapper({"qwen3": "Qwen3ForCausalLM"}, _AUDIO_STYLE),
    # Voxtral: Whisper's encoder into a Llama / Mistral decoder (audio: multimodal/voxtral.py);
    # transformers (AutoModel) and vLLM build any text model
    "VoxtralForConditionalGeneration": Wrapper(
        {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"},
        _AUDIO_STYLE,
        any_text=True,
    ),
    # Voxtral Realtime: a causal tower's rows added to Mistral's token embeddings (audio:
    # multimodal/voxtral_realtime.py; decoder: models/voxtral_realtime.py)
    "VoxtralRealtimeForConditionalGeneration": Wrapper(
        {"voxtral_realtime_text": "VoxtralRealtimeTextForCausalLM"},
        _AUDIO_STYLE,
        carried=("default_num_delay_tokens",),
    ),
    "Qwen2VLForConditionalGeneration": Wrapper(
        {"qwen2_vl_text": "Qwen2ForCausalLM"}, _QWEN_VISUAL, mrope=True
    ),
    "Qwen2_5_VLForConditionalGeneration": Wrapper(
        {"qwen2_5_vl_text": "Qwen2ForCausalLM"}, _QWEN_VISUAL, mrope=True
    ),
    # Tarsier2 (vLLM's name): Qwen2-VL under LLaVA's names (models/tarsier2_config.py); the
    # decoder's `language_model.model.` / `language_model.lm_head.` are _RENAMES'
    "Tarsier2ForConditionalGeneration": Wrapper(
        {"qwen2_vl_text": "Qwen2ForCausalLM"}, _modules("vision_tower"), mrope=True
    ),
    # jina-reranker-m0 (remote code): Qwen2-VL with a score head (models/jina_vl_ranker.py)
    "JinaVLForRanking": Wrapper(
        {"qwen2_vl_text": "JinaVLForSequenceClassification"},
        _QWEN_VISUAL,
        mrope=True,
        fixed=(("num_labels", 1),),
    ),
    "Qwen3VLForConditionalGeneration": Wrapper(
        {"qwen3_vl_text": "Qwen3ForCausalLM"}, _QWEN_VISUAL, mrope=True
    ),
    "Qwen3VLMoeForConditionalGeneration": Wrapper(
        {"qwen3_vl_moe_text": "Qwen3MoeForCausalLM"},
        _QWEN_VISUAL,
        mrope=True,
        renormalized_topk=True,
        hub_experts=True,
    ),
    # Hybrid linear-attention decoders (models/qwen3_next.py). Qwen3.5-MoE's Hub checkpoints
    # hold per-expert matrices, and its router always renormalizes.
    "Qwen3_5ForConditionalGeneration": Wrapper(
        {"qwen3_5_text": "Qwen3_5ForCausalLM"}, _QWEN_VISUAL, mrope=True
    ),
    "Qwen3_5MoeForConditionalGeneration": Wrapper(
        {"qwen3_5_moe_text": "Qwen3_5MoeForCausalLM"},
        _QWEN_VISUAL,
        mrope=True,
        renormalized_topk=True,
    ),
    "Qwen4ExpForConditionalGeneration": Wrapper(
        {"qwen4_exp_text": "Qwen4ExpForCausalLM"}, _QWEN_VISUAL, mrope=True
    ),
    # MiniMax M3: its tower, projector and the release's patch-merge MLP (images:
    # multimodal/minimax_m3_vl.py)
    "MiniMaxM3SparseForConditionalGeneration": Wrapper(
        {"minimax_m3_vl_text": "MiniMaxM3VLForCausalLM"},
        (*_LLAVA_STYLE, *_modules("patch_merge_mlp")),
    ),
    # MiniMax-VL-01 (remote code): LLaVA-NeXT's names around MiniMax-Text-01 (the release's
    # config names: models/minimax_vl_01_config.py; images: multimodal/minimax_vl_01.py)
    "MiniMaxVL01ForConditionalGeneration": Wrapper(
        {"minimax_text_01": "MiniMaxText01ForCausalLM"}, _LLAVA_NEXT
    ),
    # BLIP-2: a ViT, the Q-Former and language_projection (images: multimodal/blip2.py) into
    # a decoder-only text model, released around OPT; transformers (AutoModelForCausalLM) and
    # vLLM build any (the Flan-T5 variants, encoder-decoders, are refused)
    "Blip2ForConditionalGeneration": Wrapper(
        {"opt": "OPTForCausalLM"},
        (*_modules("vision_model", "qformer", "language_projection"), "query_tokens"),
        nested_head=True,
        any_text=True,
    ),
    # Inkling (text: models/inkling.py; its vision and audio towers dropped) and Inkling 2 /
    # 2 Loop (models/inkling2.py): on text the wrappers run their text model's logits
    "InklingForConditionalGeneration": Wrapper(
        {"inkling_text": "InklingForCausalLM"},
        _modules("vision_tower", "audio_tower", "visual", "audio"),
    ),
    "Inkling2ForConditionalGeneration": Wrapper(
        {"inkling2_text": "Inkling2ForCausalLM"}, _modules("vision_tower", "visual")
    ),
    "Inkling2LoopForConditionalGeneration": Wrapper(
        {"inkling2_loop_text": "Inkling2LoopForCausalLM"}, _modules("vision_tower", "visual")
    ),
    # Fuyu: no tower, its patches' linear projection `vision_embed_tokens` (images:
    # multimodal/fuyu.py) into Persimmon
    "FuyuForCausalLM": Wrapper(
        {"persimmon": "PersimmonForCausalLM"}, _modules("vision_embed_tokens")
    ),
    # Step 3.7: a SigLIP-style tower and its projector (the release's `vit_large_projector`)
    # into Laguna's stack with Gemma norms and clamped experts (models/step3p7.py)
    "Step3p7ForConditionalGeneration": Wrapper(
        {"step3p5": "Step3p7TextForCausalLM"},
        (*_modules("vision_model", "multi_modal_projector"), "vit_large_projector."),
    ),
    # Hy-V4-VL: Hy-V4's decoder, its MLA latent norms at rms_norm_eps (models/hy_v4_vl.py);
    # M-RoPE plain on text. The release's names: the decoder under `model.`, the tower `vit.`
    "HYV4VLForConditionalGeneration": Wrapper(
        {"hy_v4_vl_text": "HYV4VLTextForCausalLM"},
        _modules("vision_tower", "vit", "perceive", "patch_merger"),
        mrope=True,
    ),
    # Cosmos3 Edge: a SigLIP2 tower and merger into a relu^2 Llama (models/cosmos3_edge.py);
    # M-RoPE plain on text. The release keeps the decoder at the top level
    "Cosmos3EdgeForConditionalGeneration": Wrapper(
        {"cosmos3_edge_text": "Cosmos3EdgeTextForCausalLM"},
        _modules("visual", "projector"),
        mrope=True,
        renames=(
            ("embed_tokens.", "model.embed_tokens."),
            ("layers.", "model.layers."),
            ("norm.", "model.norm."),
        ),
    ),
    # PerceptionLM and FastVLM: timm towers (PE, FastViTHD: their images are refused) and
    # LLaVA-style projectors (PerceptionLM's pools 2 x 2) around Llama / Qwen2
    "PerceptionLMForConditionalGeneration": Wrapper({"llama": "LlamaForCausalLM"}, _LLAVA_STYLE),
    "FastVlmForConditionalGeneration": Wrapper({"qwen2": "Qwen2ForCausalLM"}, _LLAVA_STYLE),
    # the Hub's remote-code InternVL (multimodal/internvl_chat.py reads its config.json into
    # InternVLConfig: llm_config as text_config): its LLM as `language_model.model.` /
    # `language_model.lm_head.` (_RENAMES), InternLM2's head as `language_model.output.`
    "InternVLChatModel": Wrapper(
        {
            "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM",
            "llama": "LlamaForCausalLM",
            "internlm2": "InternLM2ForCausalLM",
            "internlm2_ve": "InternLM2VEForCausalLM",  # Mono-InternVL (mono_internvl.py)
        },
        ("vision_model.", "mlp1."),
        renames=(("language_model.output.", "output."),),
    ),
    # Skywork-R1V: InternVLChatModel's layout and config under its own names
    "SkyworkR1VChatModel": Wrapper(
        {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"},
        ("vision_model.", "mlp1."),
    ),
    # H2OVL-Mississippi: InternVLChatModel's layout and config, an H2O-Danube decoder
    "H2OVLChatModel": Wrapper(
        {"mistral": "MistralForCausalLM", "llama": "LlamaForCausalLM"},
        ("vision_model.", "mlp1."),
    ),
    # NVLM-D: InternVLChatModel's layout and config, a Qwen2 LLM (images: multimodal/nvlm_d.py)
    "NVLM_D": Wrapper({"qwen2": "Qwen2ForCausalLM"}, ("vision_model.", "mlp1.")),
    # Ultravox (fixie-ai's remote code; config: models/ultravox_config.py): Whisper's encoder
    # and a stacking projector (audio: multimodal/ultravox.py) into Llama at `language_model.`
    "UltravoxModel": Wrapper({"llama": "LlamaForCausalLM"}, _AUDIO_STYLE),
    # MiniCPM-OCR: MiniCPM-V 4.6's model under another name (images: multimodal/minicpm_ocr.py)
    "MiniCPMOcrForConditionalGeneration": Wrapper(
        {"qwen3_5_text": "Qwen3_5ForCausalLM"}, _MINICPMV, mrope=True
    ),
    # Nemotron-H Omni: a C-RADIO tower (images: multimodal/nemotron_h_omni.py), a Parakeet
    # audio encoder (not run) and their relu^2 projectors around NemotronHForCausalLM at
    # `language_model.` (its stack as `backbone.`); the Hub's names (what transformers 5
    # saves) and transformers' in-memory ones
    "NemotronH_Omni_Reasoning_V3": Wrapper(
        {"nemotron_h": "NemotronHForCausalLM"},
        _modules(
            "vision_model",
            "vision_projector",
            "mlp1",
            "sound_encoder",
            "sound_projection",
            "vision_final_layernorm",
            "multi_modal_projector",
            "audio_tower",
            "embed_audio",
        ),
        renames=(("language_model.backbone.", "backbone."),),
    ),
    # Nemotron Nano VL v2 (remote code; config: models/nemotron_nano_vl_config.py): Omni's
    # tower and projector on tiles (multimodal/nemotron_nano_vl.py), NemotronHForCausalLM at
    # `language_model.` (its stack as `backbone.`)
    "NemotronH_Nano_VL_V2": Wrapper(
        {"nemotron_h": "NemotronHForCausalLM"},
        _modules("vision_model", "mlp1"),
        renames=(("language_model.backbone.", "backbone."),),
    ),
    # Llama Nemotron Nano VL v1 (remote code; config: models/nemotron_vl_v1_config.py): v2's
    # C-RADIO tiles and InternVL's projector (multimodal/nemotron_vl_v1.py), LlamaForCausalLM
    # at `language_model.` (`language_model.model.` / `language_model.lm_head.`: _RENAMES)
    "Llama_Nemotron_Nano_VL": Wrapper(
        {"llama": "LlamaForCausalLM"}, _modules("vision_model", "mlp1")
    ),
    # Phi-3 / 3.5-vision (remote code; config: models/phi3v_config.py): Phi-3's decoder, its
    # fields at the top level; CLIP, separators and projector under `model.vision_embed_tokens.`
    # (multimodal/phi3v.py), whose `wte` is the decoder's embedding table
    "Phi3VForCausalLM": Wrapper(
        {"phi3_v": "Phi3ForCausalLM"},
        tuple(f"model.vision_embed_tokens.{m}" for m in ("img_processor.", "img_projection."))
        + ("model.vision_embed_tokens.glb_GN", "model.vision_embed_tokens.sub_GN"),
        flat=True,
        renames=(("model.vision_embed_tokens.wte.", "model.embed_tokens."),),
    ),
    # Phi-4-multimodal as the Hub ships it (remote code; config: models/phi4mm_config.py):
    # transformers' row, the decoder's PEFT-wrapped names unwrapped and its adapters dropped
    "Phi4MMForCausalLM": Wrapper(
        {"phi4_multimodal": "Phi3ForCausalLM"},
        _modules("embed_tokens_extend"),
        flat=True,
        remote_phi4mm=True,
    ),
    # CLIP / SigLIP as embedding models (vLLM's CLIPEmbeddingModel / SiglipEmbeddingModel):
    # the text tower and its projection (models/dual_encoder_text.py); their images:
    # multimodal/dual_encoder.py
    "CLIPModel": Wrapper(
        {"clip_text_model": "CLIPEmbeddingModel"},
        ("vision_model.", "visual_projection.", "logit_scale"),
        carried=("projection_dim",),
    ),
    "SiglipModel": Wrapper(
        {"siglip_text_model": "SiglipEmbeddingModel"},
        ("vision_model.", "logit_scale", "logit_bias"),
    ),
    # EmbeddingGemma 2 (vLLM's EmbeddingGemma2Model): its text encoder under `language_model.`
    # (models/embedding_gemma2.py); Gemma 4's towers dropped here (multimodal/ loads them)
    "EmbeddingGemma2Model": Wrapper(
        {"embedding_gemma2_text": "EmbeddingGemma2TextModel"},
        _GEMMA4_TOWERS,
        renames=(("language_model.", "model."),),
        carried=("is_matryoshka", "matryoshka_dimensions"),  # vLLM reads them at the top
    ),
    # GLM-4V 9B (remote code; config: models/glm4v_remote_config.py): ChatGLM / GLM-4 under its
    # own `transformer.` names, EVA2-CLIP and the projector under `transformer.vision.`
    # (multimodal/glm4v_remote.py); the text copy drops vision_config (chatglm.py refuses it)
    "GLM4VForCausalLM": Wrapper(
        {"chatglm": "ChatGLMModel"},
        ("transformer.vision.",),
        flat=True,
        fixed=(("vision_config", None),),
    ),
}

# Set on the text config we return: the wrapper it came from (selects the weight mapping).
