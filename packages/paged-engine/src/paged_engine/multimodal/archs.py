"""The vision-language wrappers whose images paged runs, and which image path each takes.

    LlavaForConditionalGeneration                 "llava"       multimodal/llava.py
    LlavaNextForConditionalGeneration,            "llava_next"  multimodal/llava_next.py
      LlavaOnevisionForConditionalGeneration (anyres_max)
    BeeForConditionalGeneration                   "bee"         multimodal/bee.py (Bee-8B, remote
      code: config models/bee_config.py; OneVision's model, its own projector, Qwen3)
    Qwen2VLForConditionalGeneration,              "qwen2_vl"    multimodal/qwen2_vl.py
      Qwen2_5_VLForConditionalGeneration, Qwen3VLForConditionalGeneration,
      Qwen3VLMoeForConditionalGeneration (Qwen3-VL: its own tower, deepstack),
      Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration (its tower)
    Glm4vForConditionalGeneration,                "glm4v"       multimodal/glm4v.py
      Glm4vMoeForConditionalGeneration, Glm46VForConditionalGeneration
    Qwen2_5OmniThinkerForConditionalGeneration,   "qwen_omni"   multimodal/qwen_omni.py
      Qwen3OmniMoeThinkerForConditionalGeneration (their towers: Qwen2.5-VL's, Qwen3-VL's)
    GlmOcrForConditionalGeneration                "glm_ocr"     multimodal/glm_ocr.py
    HunYuanVLForConditionalGeneration             "hunyuan_vl"  multimodal/hunyuan_vl.py
    PaddleOCRVLForConditionalGeneration           "paddleocr_vl"  multimodal/paddleocr_vl.py
    Ernie4_5_VLMoeForConditionalGeneration        "ernie4_5_vl"  multimodal/ernie4_5_vl.py
    Idefics3ForConditionalGeneration,             "idefics3"    multimodal/idefics3.py
      SmolVLMForConditionalGeneration
    InternVLForConditionalGeneration              "internvl"    multimodal/internvl.py
    InternS1ForConditionalGeneration              "internvl"    (Intern-S1: InternVL under its
      own model_type; config models/hub_vlm_configs.py)
    QianfanOCRForConditionalGeneration        "qianfan_ocr"  multimodal/qianfan_ocr.py
      (Qianfan-OCR: InternVL's host side, projector and tower layer; its own layer names)
    InternVLChatModel,                       "internvl_chat"  multimodal/internvl_chat.py
      SkyworkR1VChatModel (the Hub's remote-code InternVL and Skywork-R1V: their config and
      names mapped onto InternVL's)
    H2OVLChatModel                                "h2ovl"       multimodal/h2ovl.py (remote
      code: InternVL-Chat's config, names and encoder; one image alone tiled by MSAC)
    NVLM_D                                        "nvlm_d"      multimodal/nvlm_d.py (NVLM-D,
      remote code: InternVL-Chat's config and names; its projector, <|vision_pad|>, tile tags)
    Mistral3ForConditionalGeneration,             "pixtral"     multimodal/pixtral.py
      LlavaForConditionalGeneration with a Pixtral tower (Pixtral-12B)
    Gemma3ForConditionalGeneration                "gemma3"      multimodal/gemma3.py
    Gemma4ForConditionalGeneration                "gemma4"      multimodal/gemma4.py
    Gemma4UnifiedForConditionalGeneration  "gemma4_unified"  multimodal/gemma4_unified.py
    EmbeddingGemma2Model                          "gemma4"      (EmbeddingGemma 2: Gemma 4's tower
      into an encoder, models/embedding_gemma2.py; images only)
    Llama4ForConditionalGeneration                "llama4"      multimodal/llama4.py
    AyaVisionForConditionalGeneration             "aya_vision"  multimodal/aya_vision.py
    Cohere2VisionForConditionalGeneration         "cohere2_vision"  multimodal/aya_vision.py
    Idefics2ForConditionalGeneration              "idefics2"    multimodal/idefics2.py
    Kimi_K25ForConditionalGeneration              "kimi_k25"    multimodal/kimi_k25.py
    KimiVLForConditionalGeneration                "kimi_vl"     multimodal/kimi_vl.py (remote
      code: config models/kimi_vl_config.py; K2.5's tower and projector, its own processor)
    MiniCPMV4_6ForConditionalGeneration           "minicpmv"    multimodal/minicpmv.py
    MiniCPMV4_7ForConditionalGeneration     "minicpmv_canvas"   multimodal/minicpmv.py
    MiniCPMOcrForConditionalGeneration      "minicpm_ocr"  multimodal/minicpmv.py (MiniCPM-V
      4.6's model; its torch image processor and layout: multimodal/minicpm_ocr.py)
    MiniCPMV                              "minicpmv_remote"  multimodal/minicpmv_remote.py
      (the Hub's remote-code MiniCPM-V 2.5 / 2.6 / 4.0 / 4.5: config minicpmv_remote_config.py;
      Idefics2's tower, a perceiver resampler into Llama 3 / Qwen2 / Qwen3; "(<image>./</image>)")
    MiniCPMO                              "minicpmv_remote"  multimodal/minicpmv_remote.py
      (MiniCPM-o 2.6, remote code: MiniCPM-V 2.6's images; its audio: audio_archs.py)
    QwenVLForConditionalGeneration            "qwen_vl_v1"  multimodal/qwen_vl_v1.py (Qwen-VL
      v1, remote code: config.json's QWenLMHeadModel with `visual`, models/qwen_vl_v1_config.py;
      OpenCLIP ViT-bigG, a perceiver resampler into Qwen v1; "<img>...</img>")
    NemotronH_Omni_Reasoning_V3         "nemotron_h_omni"  multimodal/nemotron_h_omni.py (C-RADIO,
      pixel shuffle, relu^2 projector), nemotron_h_omni_processor.py (pixels, prompt); images only
    NemotronH_Nano_VL_V2               "nemotron_nano_vl"  multimodal/nemotron_nano_vl.py (remote
      code: config models/nemotron_nano_vl_config.py; Omni's tower and projector on 512 tiles)
    Llama_Nemotron_Nano_VL                 "nemotron_vl_v1"  multimodal/nemotron_vl_v1.py (remote
      code: config models/nemotron_vl_v1_config.py; v2's C-RADIO tiles, GELU mlp1, Llama 3.1)
    Lfm2VlForConditionalGeneration                "lfm2_vl"     multimodal/lfm2_vl.py
    Ovis2_5ForConditionalGeneration               "ovis2_5"     multimodal/ovis2_5.py
    Ovis2_5                                       "ovis2_5_hub" multimodal/ovis2_5_hub.py (the
      Hub's remote-code Ovis2.5 as vLLM serves it: "<image>" text, <|image_pad|> runs; config
      models/ovis2_5_hub.py)
    Ovis2ForConditionalGeneration                 "ovis2"       multimodal/ovis2.py (tower),
      ovis2_layout.py (tiles, prompt)
    Exaone4_5_ForConditionalGeneration            "exaone4_5"   multimodal/exaone4_5.py
    LlavaOnevision15ForConditionalGeneration  "llava_onevision1_5"  multimodal/llava_onevision1_5.py
      (LLaVA-OneVision-1.5: RICE-ViT tower, Qwen3 decoder at 1-D positions)
    PaliGemmaForConditionalGeneration             "paligemma"   multimodal/paligemma.py
    MllamaForConditionalGeneration                "mllama"      multimodal/mllama.py (no
      placeholders: its decoder cross-attends, models/mllama.py; the model runs its tower)
    LightOnOcrForConditionalGeneration            "lighton_ocr" multimodal/lighton_ocr.py
    LightOnOCRForConditionalGeneration            "lighton_ocr" (LightOnOCR-1B-1025's config.json,
      vLLM's name: models/hub_vlm_configs.py)
    Molmo2ForConditionalGeneration                "molmo2"      multimodal/molmo2.py (prompt),
      molmo2_processor.py (pixels), molmo2_encoder.py (tower, adapter); no videos
    DeepseekVLForConditionalGeneration            "deepseek_vl" multimodal/deepseek_vl.py
    DeepseekVLHybridForConditionalGeneration "deepseek_vl_hybrid"  multimodal/deepseek_vl_hybrid.py
    DeepseekOCRForCausalLM                   "deepseek_ocr_v1"  multimodal/deepseek_ocr_v1.py
      (DeepSeek-OCR v1, remote code: config models/deepseek_ocr_v1_config.py; SAM + CLIP-L
      DeepEncoder deepseek_ocr_v1_encoder.py, DeepSeek-OCR-2's decoder; tiles, "<image>")
    DotsOCRForCausalLM                           "dots_ocr"    multimodal/dots_ocr.py (dots.ocr,
      remote code: config models/dots_ocr_config.py; a NaViT tower with Qwen2-VL's rope and
      merger into Qwen2 at 1-D positions; "<|img|><|imgpad|><|endofimg|>")
    DeepseekVLV2ForCausalLM                  "deepseek_vl2"  multimodal/deepseek_vl2.py
      (DeepSeek-VL2, remote code: config models/deepseek_vl2_config.py; SigLIP tower and
      downsample MLP deepseek_vl2_encoder.py, a DeepSeek-V2 MHA / MLA decoder; tiles)
    MolmoForCausalLM                         "molmo_v1"  multimodal/molmo_v1.py (Molmo v1,
      remote code: config models/molmo_v1_config.py; pixels molmo_v1_processor.py, CLIP
      tower, pooling and projector molmo_v1_encoder.py, the decoder models/molmo_v1.py;
      MolmoE-1B's OLMoE decoder models/molmoe.py)
    JanusForConditionalGeneration                 "janus"       multimodal/janus.py (its image
      understanding path; image generation, its VQ-VAE and head, not served)
    HyperCLOVAXVisionV2ForConditionalGeneration  "hyperclovax_vision_v2"
      multimodal/hyperclovax_vision_v2.py (Qwen2.5-VL's tower, a linear projector; 1-D positions)
    OpenCUAForConditionalGeneration               "opencua"     multimodal/opencua.py (OpenCUA,
      remote code: config models/opencua_config.py; Qwen2.5-VL's tower and merger into Qwen2 at
      1-D positions; runs of "<|media_placeholder|>")
    IsaacForConditionalGeneration                 "isaac"       multimodal/isaac.py (Isaac-0.1,
      remote code: config models/isaac_config.py; pixels, "<image>" runs and M-RoPE positions
      there, the SigLIP2 tower, pixel shuffle and projector isaac_encoder.py; Qwen3)
    KeyeForConditionalGeneration                  "keye"        multimodal/keye.py (Keye-VL-8B,
      remote code: config models/keye_config.py; PaddleOCR-VL's tower, projector and runs
      under the Hub's names, Qwen3 with M-RoPE; KeyeVL1_5ForConditionalGeneration, Keye-VL-1.5,
      the same with its merged-row projector, images only)
    Step3VLForConditionalGeneration     "step3_vl"  multimodal/step3_vl.py (Step3-VL, remote
      code: config models/step3_vl_config.py; a global view and 504 patches, <patch_start> /
      <im_start> runs; its ViT, conv downsamplers and projector step3_vl_encoder.py; Step3)
    Phi4MultimodalForCausalLM                     "phi4mm"      multimodal/phi4mm.py (a flat
      config: its Phi-3 decoder's fields at the top level)
    Phi3VForCausalLM                              "phi3v"       multimodal/phi3v.py (Phi-3 /
      3.5-vision, remote code: config models/phi3v_config.py; CLIP, HD crops, "<|image_i|>")
    Phi4MMForCausalLM                      "phi4mm_remote"  multimodal/phi4mm_remote.py (the
      Hub's remote-code Phi-4-multimodal on phi4mm.py's path; "<|image_i|>" / "<|audio_i|>")
    AriaForConditionalGeneration                  "aria"        multimodal/aria.py
    VipLlavaForConditionalGeneration              "vipllava"    multimodal/vipllava.py
    LlavaNextVideoForConditionalGeneration  "llava_next_video"  multimodal/llava_next_video.py
      (LLaVA-NeXT's images; its videos pooled, in the same file)
    Blip2ForConditionalGeneration                 "blip2"       multimodal/blip2.py (decoder-only
      text models: OPT, Llama, Mistral, Qwen2; Flan-T5 refused)
    ChameleonForConditionalGeneration             "chameleon"   multimodal/chameleon.py (a flat
      config; a VQ-VAE's codes as text-embedding rows: chameleon_vqvae.py; text out only)
    Emu3ForConditionalGeneration                  "emu3"        multimodal/emu3.py (its VQ-VAE's
      codes, rows ended by an end-of-line token, as text-embedding rows: emu3_vqvae.py; text out)
    CLIPModel, SiglipModel           "clip_embed", "siglip_embed"  multimodal/dual_encoder.py
      (embedding models: an image prompt is one placeholder; text towers
      models/dual_encoder_text.py)
    FuyuForCausalLM                               "fuyu"        multimodal/fuyu.py (no tower:
      patches linearly projected into Persimmon; no vision_config)
    MiniMaxM3SparseForConditionalGeneration  "minimax_m3_vl"  multimodal/minimax_m3_vl.py
      (3-D axial rope tower, patch-merge projector; 1-D text positions)
    MiniMaxVL01ForConditionalGeneration    "minimax_vl_01"  multimodal/minimax_vl_01.py (remote
      code: config models/minimax_vl_01_config.py; LLaVA-NeXT's model over MiniMax-Text-01,
      the release's anyres pixels)
    Inkling2ForConditionalGeneration,             "inkling2"    multimodal/inkling2_vl.py
      Inkling2LoopForConditionalGeneration (one token a 40-pixel cell; 1-D positions)
    CohereCompassForConditionalGeneration         "qwen2_vl"    multimodal/qwen2_vl.py (Qwen3-VL's
      tower and deepstack; the decoder's M-RoPE a rope per layer type: models/cohere_compass.py)
    JinaVLForRanking                              "qwen2_vl"    multimodal/qwen2_vl.py
      (jina-reranker-m0: Qwen2-VL's images into a reranker, models/jina_vl_ranker.py)
    Tarsier2ForConditionalGeneration              "qwen2_vl"    multimodal/qwen2_vl.py (Tarsier2:
      Qwen2-VL under LLaVA's names and config, models/tarsier2_config.py; videos too)
    MantisForConditionalGeneration                "mantis"      multimodal/mantis.py (vLLM's name,
      by hf_overrides: a LLaVA checkpoint, each image's run in "(image i: <Image>...</Image>)")
    TarsierForConditionalGeneration               "tarsier"     multimodal/tarsier.py (Tarsier v1:
      LLaVA 1.5 with a newline row after each patch row and an image-end row in the run)
    GLM4VForCausalLM                       "glm4v_remote"  multimodal/glm4v_remote.py (GLM-4V 9B,
      remote code: config.json's ChatGLMModel with a vision_config, models/
      glm4v_remote_config.py; EVA2-CLIP, 2 x 2 conv, GLU into ChatGLM; boi, pads, eoi)

Other wrappers serve their text model only (models/multimodal_text.py).
"""

from __future__ import annotations

import importlib
from typing import Any

from torch import nn

# architecture -> image kind (a LLaVA config whose tower is Pixtral's takes "pixtral")
KINDS: dict[str, str] = {
    "LlavaForConditionalGeneration": "llava",
    "LlavaNextForConditionalGeneration": "llava_next",
    "LlavaOnevisionForConditionalGeneration": "llava_next",
    "BeeForConditionalGeneration": "bee",  # Bee-8B, remote code: models/bee_config.py
    "Qwen2VLForConditionalGeneration": "qwen2_vl",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_vl",
    "Qwen3VLForConditionalGeneration": "qwen2_vl",
    "Qwen3VLMoeForConditionalGeneration": "qwen2_vl",
    "Qwen3_5ForConditionalGeneration": "qwen2_vl",
    "Qwen3_5MoeForConditionalGeneration": "qwen2_vl",
    "Tarsier2ForConditionalGeneration": "qwen2_vl",  # Qwen2-VL (models/tarsier2_config.py)
    "Glm4vForConditionalGeneration": "glm4v",
    "Glm4vMoeForConditionalGeneration": "glm4v",
    "Glm46VForConditionalGeneration": "glm4v",
    "Qwen2_5OmniThinkerForConditionalGeneration": "qwen_omni",
    "Qwen3OmniMoeThinkerForConditionalGeneration": "qwen_omni",
    "Qwen2_5OmniForConditionalGeneration": "qwen_omni",
    "Qwen3OmniMoeForConditionalGeneration": "qwen_omni",
    "GlmOcrForConditionalGeneration": "glm_ocr",
    "HunYuanVLForConditionalGeneration": "hunyuan_vl",
    "PaddleOCRVLForConditionalGeneration": "paddleocr_vl",
    "Ernie4_5_VLMoeForConditionalGeneration": "ernie4_5_vl",
    "Idefics3ForConditionalGeneration": "idefics3",
    "SmolVLMForConditionalGeneration": "idefics3",
    "Mistral3ForConditionalGeneration": "pixtral",
    "InternVLForConditionalGeneration": "internvl",
    "InternS1ForConditionalGeneration": "internvl",  # Intern-S1: hub_vlm_configs.py
    "QianfanOCRForConditionalGeneration": "qianfan_ocr",
    "Gemma3ForConditionalGeneration": "gemma3",
    "Gemma4ForConditionalGeneration": "gemma4",
    "Gemma4UnifiedForConditionalGeneration": "gemma4_unified",
    "EmbeddingGemma2Model": "gemma4",  # EmbeddingGemma 2: Gemma 4's tower, an encoder
    "Llama4ForConditionalGeneration": "llama4",
    "AyaVisionForConditionalGeneration": "aya_vision",
    "Cohere2VisionForConditionalGeneration": "cohere2_vision",
    "Idefics2ForConditionalGeneration": "idefics2",
    "Kimi_K25ForConditionalGeneration": "kimi_k25",
    "KimiVLForConditionalGeneration": "kimi_vl",  # remote code: models/kimi_vl_config.py
    "MiniCPMV4_6ForConditionalGeneration": "minicpmv",
    "MiniCPMV4_7ForConditionalGeneration": "minicpmv_canvas",
    "Lfm2VlForConditionalGeneration": "lfm2_vl",
    "Ovis2_5ForConditionalGeneration": "ovis2_5",
    "Ovis2_5": "ovis2_5_hub",  # the Hub's remote code: models/ovis2_5_hub.py
    "Ovis2ForConditionalGeneration": "ovis2",
    "Exaone4_5_ForConditionalGeneration": "exaone4_5",
    "LlavaOnevision15ForConditionalGeneration": "llava_onevision1_5",
    "PaliGemmaForConditionalGeneration": "paligemma",
    "MllamaForConditionalGeneration": "mllama",
    "LightOnOcrForConditionalGeneration": "lighton_ocr",
    "LightOnOCRForConditionalGeneration": "lighton_ocr",  # vLLM's: hub_vlm_configs.py
    "Molmo2ForConditionalGeneration": "molmo2",
    "DeepseekVLForConditionalGeneration": "deepseek_vl",
    "DeepseekVLHybridForConditionalGeneration": "deepseek_vl_hybrid",
    "DeepseekOCRForCausalLM": "deepseek_ocr_v1",  # remote code: models/deepseek_ocr_v1_config.py
    "DotsOCRForCausalLM": "dots_ocr",  # dots.ocr, remote code: models/dots_ocr_config.py
    "DeepseekVLV2ForCausalLM": "deepseek_vl2",  # remote code: models/deepseek_vl2_config.py
    "MolmoForCausalLM": "molmo_v1",  # Molmo v1, remote code: models/molmo_v1_config.py
    "JanusForConditionalGeneration": "janus",
    "HyperCLOVAXVisionV2ForConditionalGeneration": "hyperclovax_vision_v2",
    "Phi4MultimodalForCausalLM": "phi4mm",
    "AriaForConditionalGeneration": "aria",
    "VipLlavaForConditionalGeneration": "vipllava",
    "LlavaNextVideoForConditionalGeneration": "llava_next_video",
    "Blip2ForConditionalGeneration": "blip2",
    "ChameleonForConditionalGeneration": "chameleon",
    "Emu3ForConditionalGeneration": "emu3",
    "FuyuForCausalLM": "fuyu",
    "MiniMaxM3SparseForConditionalGeneration": "minimax_m3_vl",
    "MiniMaxVL01ForConditionalGeneration": "minimax_vl_01",  # remote: minimax_vl_01_config.py
    "Inkling2ForConditionalGeneration": "inkling2",
    "Inkling2LoopForConditionalGeneration": "inkling2",
    "CohereCompassForConditionalGeneration": "qwen2_vl",
    "InternVLChatModel": "internvl_chat",
    "SkyworkR1VChatModel": "internvl_chat",
    "H2OVLChatModel": "h2ovl",  # InternVL-Chat's, its own tiling (multimodal/h2ovl.py)
    "NVLM_D": "nvlm_d",  # InternVL-Chat's, its own projector and tile tags (multimodal/nvlm_d.py)
    "MiniCPMOcrForConditionalGeneration": "minicpm_ocr",
    "MiniCPMV": "minicpmv_remote",  # remote code: models/minicpmv_remote_config.py
    "MiniCPMO": "minicpmv_remote",  # MiniCPM-o 2.6: config models/minicpmo_remote_config.py
    "QwenVLForConditionalGeneration": "qwen_vl_v1",  # remote code: models/qwen_vl_v1_config.py
    "NemotronH_Omni_Reasoning_V3": "nemotron_h_omni",
    "NemotronH_Nano_VL_V2": "nemotron_nano_vl",  # remote code: models/nemotron_nano_vl_config.py
    "Llama_Nemotron_Nano_VL": "nemotron_vl_v1",  # remote code: models/nemotron_vl_v1_config.py
    "Phi3VForCausalLM": "phi3v",
    "Phi4MMForCausalLM": "phi4mm_remote",  # remote code: models/phi4mm_config.py
    "CLIPModel": "clip_embed",  # an embedding model: multimodal/dual_encoder.py
    "SiglipModel": "siglip_embed",  # the same
    "JinaVLForRanking": "qwen2_vl",  # jina-reranker-m0: models/jina_vl_ranker.py
    "MantisForConditionalGeneration": "mantis",  # LLaVA's, its prompt text (multimodal/mantis.py)
    "TarsierForConditionalGeneration": "tarsier",  # Tarsier v1: LLaVA's, separator rows
    "GLM4VForCausalLM": "glm4v_remote",  # GLM-4V, remote code: models/glm4v_remote_config.py
    "OpenCUAForConditionalGeneration": "opencua",  # remote code: models/opencua_config.py
    "IsaacForConditionalGeneration": "isaac",  # remote code: models/isaac_config.py
    "KeyeForConditionalGeneration": "keye",  # remote code: models/keye_config.py
    "KeyeVL1_5ForConditionalGeneration": "keye",  # Keye-VL-1.5: its projector (multimodal/keye.py)
    "Step3VLForConditionalGeneration": "step3_vl",  # remote code: models/step3_vl_config.py
}
IMAGE_ARCHS = tuple(KINDS)
# vLLM's names reached by hf_overrides for a checkpoint read as another wrapper (the value): the
# text model and tower that wrapper's, the host side the name's (loader.apply_hf_overrides)
SERVED_AS: dict[str, str] = {"MantisForConditionalGeneration": "LlavaForConditionalGeneration"}
# the checkpoints whose videos run (multimodal/video_archs.py's table of their processors),
# for messages
VIDEO_MODELS = (
    "Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5, GLM-4.1V / 4.5V / 4.6V, Gemma 4, LLaVA-NeXT-Video, "
    "Kimi K2.5, Tarsier2, Ovis2.5 (one per prompt) and the Qwen2.5-Omni / Qwen3-Omni thinkers"
)

# kind -> the vision_config.model_type(s) we run; LLaVA's, LLaVA-NeXT's and Idefics2's are
# vision_transformer.py's TOWERS; the other kinds run the tower their encoder builds
TOWER_TYPES: dict[str, tuple[str, ...]] = {
    "gemma3": ("siglip_vision_model",),
    "aya_vision": ("siglip_vision_model",),
    "cohere2_vision": ("siglip_vision_model",),
    "gemma4": ("gemma4_vision",),
    "gemma4_unified": ("gemma4_unified_vision",),  # no tower: its encoder-free embedder
    "hunyuan_vl": ("hunyuan_vl_vision",),
    "paddleocr_vl": ("paddleocr_vl_vision",),
    "keye": ("paddleocr_vl_vision",),  # siglip_vision_model read as it (keye_config.py)
    "ernie4_5_vl": ("ernie4_5_vl_moe_vision",),
    "kimi_k25": ("kimi_k25_vision",),
    "kimi_vl": ("kimi_k25_vision",),  # MoonViT, read into K2.5's config
    "minicpmv": ("minicpmv4_6_vision", "minicpmv4_7_vision"),
    "minicpmv_canvas": ("minicpmv4_6_vision", "minicpmv4_7_vision"),
    "lfm2_vl": ("siglip2_vision_model",),
    "ovis2_5": ("ovis2_5_vision",),
    "ovis2_5_hub": ("ovis2_5_vision",),  # vit_config read into the port's (ovis2_5_hub.py)
    "ovis2": ("ovis2_vision",),
    "exaone4_5": ("exaone4_5_vision",),
    "llava_onevision1_5": ("llava_onevision1_5_vision",),
    "bee": ("siglip_vision_model",),  # Bee-8B's SigLIP (models/bee_config.py)
    "paligemma": ("siglip_vision_model",),
    "lighton_ocr": ("pixtral",),
    "molmo2": ("molmo2_vision",),
    "molmo_v1": ("clip_vision_model",),  # ViT-L/14-336 (models/molmo_v1_config.py)
    "dots_ocr": ("dots_vit",),  # the release's NaViT (models/dots_ocr_config.py)
    "deepseek_vl": ("siglip_vision_model",),
    "deepseek_vl_hybrid": ("siglip_vision_model",),  # and SAM's (its encoder checks)
    "janus": ("janus_vision_model",),
    "hyperclovax_vision_v2": ("qwen2_5_vl_vision",),
    "phi4mm": ("phi4_multimodal_vision",),
    "aria": ("idefics3_vision",),
    "blip2": ("blip_2_vision_model",),
    "chameleon": ("chameleon_vqgan",),  # vq_config.model_type: its VQ-VAE
    "emu3": ("emu3_vqgan",),  # vq_config.model_type: its VQ-VAE
    "minimax_m3_vl": ("minimax_m3_vl_vision",),
    "minimax_vl_01": ("clip_vision_model",),  # the release's CLIP (minimax_vl_01_config.py)
    "inkling2": ("inkling2_vision",),
    "qianfan_ocr": ("qianfan_ocr_vision",),
    "minicpm_ocr": ("minicpm_ocr_vision",),
    "minicpmv_remote": ("idefics2_vision",),  # the release's SigLIP (minicpmv_remote_config.py)
    "nemotron_h_omni": ("radio",),
    "nemotron_nano_vl": ("radio",),  # RadioConfig built from vision_config.args
    "nemotron_vl_v1": ("radio",),  # RadioConfig built from vision_config.args
    "phi3v": ("clip_vision_model",),  # ViT-L/14-336 (models/phi3v_config.py)
    "phi4mm_remote": ("phi4_multimodal_vision",),  # so400m (models/phi4mm_config.py)
    "clip_embed": ("clip_vision_model",),
    "siglip_embed": ("siglip_vision_model",),
    "opencua": ("qwen2_5_vl", "qwen2_5_vl_vision"),  # Qwen2.5-VL's (models/opencua_config.py)
    "isaac": ("siglip2_vision_model",),  # pixel_shuffle_siglip2 read as it (isaac_config.py)
    "step3_vl": ("step3_vision_encoder",),  # else its geometry's reason (step3_vl_config.py)
}

# kind -> "module:callable" under paged_engine.multimodal: the encoder class (or a function
# choosing one) called with the wrapper's config ("mllama": none, its model encodes)
ENCODERS: dict[str, str] = {
    "llava": "llava:LlavaImageEncoder",
    "llava_next": "llava_next:LlavaNextImageEncoder",
    "bee": "bee:BeeImageEncoder",  # LLaVA-OneVision's with Bee's projector
    "qwen2_vl": "qwen2_vl:build_encoder",
    "glm4v": "glm4v:Glm4vImageEncoder",
    "qwen_omni": "qwen_omni:build_encoder",
    "glm_ocr": "glm_ocr:GlmOcrImageEncoder",
    "hunyuan_vl": "hunyuan_vl:HunyuanImageEncoder",
    "paddleocr_vl": "paddleocr_vl:PaddleOCRImageEncoder",
    "ernie4_5_vl": "ernie4_5_vl:ErnieImageEncoder",
    "idefics3": "idefics3:Idefics3ImageEncoder",
    "pixtral": "pixtral:PixtralImageEncoder",
    "internvl": "internvl:InternVLImageEncoder",
    "qianfan_ocr": "qianfan_ocr:QianfanOCRImageEncoder",
    "gemma3": "gemma3:Gemma3ImageEncoder",
    "gemma4": "gemma4:Gemma4ImageEncoder",
    "gemma4_unified": "gemma4_unified:Gemma4UnifiedImageEncoder",
    "llama4": "llama4:Llama4ImageEncoder",
    "aya_vision": "aya_vision:AyaVisionImageEncoder",
    "cohere2_vision": "aya_vision:AyaVisionImageEncoder",
    "idefics2": "idefics2:Idefics2ImageEncoder",
    "kimi_k25": "kimi_k25:KimiImageEncoder",
    "kimi_vl": "kimi_vl:KimiVLImageEncoder",
    "minicpmv": "minicpmv:MiniCPMVImageEncoder",
    "minicpmv_canvas": "minicpmv:MiniCPMVImageEncoder",
    "lfm2_vl": "lfm2_vl:Lfm2VlImageEncoder",
    "ovis2_5": "ovis2_5:Ovis2_5ImageEncoder",
    "ovis2_5_hub": "ovis2_5_hub:Ovis2_5HubImageEncoder",
    "ovis2": "ovis2:Ovis2ImageEncoder",
    "exaone4_5": "exaone4_5:Exaone45ImageEncoder",
    "llava_onevision1_5": "llava_onevision1_5:LlavaOnevision15ImageEncoder",
    "paligemma": "paligemma:PaliGemmaImageEncoder",
    "lighton_ocr": "lighton_ocr:LightOnOcrImageEncoder",
    "molmo2": "molmo2_encoder:Molmo2ImageEncoder",
    "deepseek_vl": "deepseek_vl:DeepseekVLImageEncoder",
    "deepseek_vl_hybrid": "deepseek_vl_hybrid:DeepseekVLHybridImageEncoder",
    "deepseek_ocr_v1": "deepseek_ocr_v1_encoder:DeepseekOCRImageEncoder",
    "dots_ocr": "dots_ocr:DotsOCRImageEncoder",
    "deepseek_vl2": "deepseek_vl2_encoder:DeepseekVL2ImageEncoder",
    "molmo_v1": "molmo_v1_encoder:MolmoV1ImageEncoder",
    "janus": "janus:JanusImageEncoder",
    "hyperclovax_vision_v2": "hyperclovax_vision_v2:HyperCLOVAXVisionV2ImageEncoder",
    "phi4mm": "phi4mm:Phi4MMImageEncoder",
    "aria": "aria:AriaImageEncoder",
    "vipllava": "vipllava:VipLlavaImageEncoder",
    "llava_next_video": "llava_next_video:LlavaNextVideoEncoder",
    "blip2": "blip2:Blip2ImageEncoder",
    "chameleon": "chameleon:ChameleonImageEncoder",
    "emu3": "emu3:Emu3ImageEncoder",
    "fuyu": "fuyu:FuyuImageEncoder",  # no tower: vision_embed_tokens alone
    "minimax_m3_vl": "minimax_m3_vl:MiniMaxM3ImageEncoder",
    "minimax_vl_01": "llava_next:LlavaNextImageEncoder",  # LLaVA-NeXT's model, its own pixels
    "inkling2": "inkling2_vl:Inkling2ImageEncoder",
    "internvl_chat": "internvl_chat:InternVLChatImageEncoder",
    "h2ovl": "internvl_chat:InternVLChatImageEncoder",
    "nvlm_d": "nvlm_d:NVLMImageEncoder",
    "minicpm_ocr": "minicpmv:MiniCPMVImageEncoder",
    "minicpmv_remote": "minicpmv_remote:MiniCPMVRemoteImageEncoder",
    "qwen_vl_v1": "qwen_vl_v1:QwenVLImageEncoder",
    "nemotron_h_omni": "nemotron_h_omni:NemotronOmniImageEncoder",
    "nemotron_nano_vl": "nemotron_nano_vl:NanoNemotronVLImageEncoder",
    "nemotron_vl_v1": "nemotron_vl_v1:NemotronVLV1ImageEncoder",
    "phi3v": "phi3v:Phi3VImageEncoder",
    "phi4mm_remote": "phi4mm_remote:Phi4MMRemoteImageEncoder",
    "clip_embed": "dual_encoder:CLIPImageEmbedder",
    "siglip_embed": "dual_encoder:SiglipImageEmbedder",
    "mantis": "llava:LlavaImageEncoder",  # LLaVA's model (the worker reads config.json's kind)
    "tarsier": "tarsier:TarsierImageEncoder",
    "glm4v_remote": "glm4v_remote:Glm4vRemoteImageEncoder",
    "opencua": "opencua:OpenCUAImageEncoder",
    "isaac": "isaac_encoder:IsaacImageEncoder",
    "keye": "keye:KeyeImageEncoder",  # Keye-VL: PaddleOCR-VL's tower, projector (1.5's: its own)
    "step3_vl": "step3_vl_encoder:Step3VLImageEncoder",
}


def image_kind(config: Any) -> str:
    """The image path (a KINDS value) of a wrapper config of IMAGE_ARCHS."""
    archs = getattr(config, "architectures", None) or []
    kind = next((KINDS[a] for a in archs if a in KINDS), None)
    assert kind is not None, archs
    if kind == "llava" and vision_tower_type(config) == "pixtral":
        return "pixtral"
    return kind


def vision_tower_type(config: Any) -> str | None:
    if getattr(config, "vision_config", None) is None and hasattr(config, "vq_config"):
        return getattr(config.vq_config, "model_type", None)  # Chameleon, Emu3: VQ-VAEs
    return getattr(config.vision_config, "model_type", None)


def supported_tower(config: Any) -> bool:
    """Whether paged runs the wrapper's vision tower (LLaVA's may be a Pixtral one: not yet)."""
    kind = image_kind(config)
    if kind in TOWER_TYPES:
        return vision_tower_type(config) in TOWER_TYPES[kind]
    if kind in ("llava", "llava_next", "idefics2", "vipllava", "llava_next_video", "tarsier"):
        from paged_engine.multimodal.vision_transformer import TOWERS

        return vision_tower_type(config) in TOWERS
    return True


def build_encoder(config: Any) -> nn.Module:
    """The wrapper's image encoder (tower and projector), with `encode(images)` and
    `load_weights(weights)`; built in the current default dtype and device."""
    module, name = ENCODERS[image_kind(config)].split(":")
    return getattr(importlib.import_module(f"paged_engine.multimodal.{module}"), name)(config)
