"""Which `Layout` each image wrapper's prompts use, keyed by `archs.image_kind` (processor.py
looks a model's up). Every family module is imported here, so none imports another."""

from __future__ import annotations

from paged_engine.multimodal.aria import AriaLayout
from paged_engine.multimodal.bee import BeeLayout
from paged_engine.multimodal.blip2 import Blip2Layout
from paged_engine.multimodal.chameleon import ChameleonLayout
from paged_engine.multimodal.deepseek_ocr_v1 import DeepseekOCRLayout
from paged_engine.multimodal.deepseek_vl import DeepseekVLLayout
from paged_engine.multimodal.deepseek_vl2 import DeepseekVL2Layout
from paged_engine.multimodal.deepseek_vl_hybrid import DeepseekVLHybridLayout
from paged_engine.multimodal.dual_encoder import DualEncoderLayout
from paged_engine.multimodal.emu3 import Emu3Layout
from paged_engine.multimodal.ernie4_5_vl import ErnieLayout
from paged_engine.multimodal.fuyu import FuyuLayout
from paged_engine.multimodal.glm4v_remote import Glm4vRemoteLayout
from paged_engine.multimodal.h2ovl import H2OVLLayout
from paged_engine.multimodal.inkling2_vl import Inkling2Layout
from paged_engine.multimodal.internvl_chat import InternVLChatLayout
from paged_engine.multimodal.isaac import IsaacLayout
from paged_engine.multimodal.janus import JanusLayout
from paged_engine.multimodal.keye import KeyeLayout
from paged_engine.multimodal.kimi_vl import KimiVLLayout
from paged_engine.multimodal.layouts import Layout
from paged_engine.multimodal.layouts_gemma import (
    Gemma3Layout,
    Gemma4Layout,
    Gemma4UnifiedLayout,
)
from paged_engine.multimodal.layouts_qwen import (
    Exaone45Layout,
    HunyuanLayout,
    OmniLayout,
    Ovis2_5Layout,
    QwenLayout,
)
from paged_engine.multimodal.layouts_single_run import (
    AnyResLayout,
    BoundedLayout,
    KimiLayout,
    LineLayout,
)
from paged_engine.multimodal.layouts_slices import (
    Lfm2VlLayout,
    MiniCPMVCanvasLayout,
    MiniCPMVLayout,
)
from paged_engine.multimodal.layouts_tiles import (
    AyaLayout,
    CohereTiles,
    Idefics2Layout,
    Llama4Layout,
    TileLayout,
)
from paged_engine.multimodal.lighton_ocr import LightOnOcrLayout
from paged_engine.multimodal.llava_onevision1_5 import LlavaOnevision15Layout
from paged_engine.multimodal.mantis import MantisLayout
from paged_engine.multimodal.minicpm_ocr import MiniCPMOcrLayout
from paged_engine.multimodal.minicpmv_remote import MiniCPMVRemoteLayout
from paged_engine.multimodal.minimax_m3_vl import MiniMaxM3Layout
from paged_engine.multimodal.minimax_vl_01 import MiniMaxVL01Layout
from paged_engine.multimodal.mllama_layout import MllamaLayout
from paged_engine.multimodal.molmo2 import Molmo2Layout
from paged_engine.multimodal.molmo_v1 import MolmoV1Layout
from paged_engine.multimodal.nemotron_h_omni_processor import NemotronOmniLayout
from paged_engine.multimodal.nemotron_nano_vl import NanoNemotronVLLayout
from paged_engine.multimodal.nemotron_vl_v1 import NemotronVLV1Layout
from paged_engine.multimodal.nvlm_d import NVLMLayout
from paged_engine.multimodal.ovis2_5_hub import Ovis2_5HubLayout
from paged_engine.multimodal.ovis2_layout import Ovis2Layout
from paged_engine.multimodal.paddleocr_vl import PaddleOCRLayout
from paged_engine.multimodal.paligemma_layout import PaliGemmaLayout
from paged_engine.multimodal.phi3v import Phi3VLayout
from paged_engine.multimodal.phi4mm import Phi4MMLayout
from paged_engine.multimodal.phi4mm_remote import Phi4MMRemoteLayout
from paged_engine.multimodal.qianfan_ocr import QianfanLayout
from paged_engine.multimodal.qwen_vl_v1 import QwenVLLayout
from paged_engine.multimodal.step3_vl import Step3VLLayout
from paged_engine.multimodal.tarsier import TarsierLayout

LAYOUTS: dict[str, type[Layout]] = {
    "llava": Layout,
    "llava_next": AnyResLayout,
    "bee": BeeLayout,  # Bee-8B: LLaVA-NeXT's runs on every image, OneVision's scaling
    "qwen2_vl": QwenLayout,
    "glm4v": QwenLayout,  # GLM-4.1V / 4.5V / 4.6V: Qwen2-VL's runs and M-RoPE table
    "qwen_omni": OmniLayout,
    "glm_ocr": QwenLayout,  # GLM-OCR: GLM-4.1V's host side
    "hunyuan_vl": HunyuanLayout,  # HunyuanOCR
    "paddleocr_vl": PaddleOCRLayout,  # PaddleOCR-VL: Qwen2-VL's runs and M-RoPE table
    "keye": KeyeLayout,  # Keye-VL (remote code): PaddleOCR-VL's, its own processor settings
    "ernie4_5_vl": ErnieLayout,  # ERNIE 4.5 VL: Qwen2-VL's runs and M-RoPE table
    "idefics3": TileLayout,
    "pixtral": LineLayout,
    "internvl": BoundedLayout,
    "qianfan_ocr": QianfanLayout,  # Qianfan-OCR: InternVL's, <image> markers taken too
    "gemma3": Gemma3Layout,
    "gemma4": Gemma4Layout,
    "gemma4_unified": Gemma4UnifiedLayout,  # Gemma 4 Unified: one token per model patch
    "aya_vision": AyaLayout,
    "cohere2_vision": CohereTiles,
    "idefics2": Idefics2Layout,
    "llama4": Llama4Layout,
    "kimi_k25": KimiLayout,
    "kimi_vl": KimiVLLayout,  # Kimi-VL (remote code): K2.5's runs, its own processor
    "lfm2_vl": Lfm2VlLayout,
    "ovis2_5": Ovis2_5Layout,
    "ovis2_5_hub": Ovis2_5HubLayout,  # Ovis2.5's Hub release: "<image>" -> <|image_pad|> runs
    "ovis2": Ovis2Layout,  # Ovis2: tiles, "<image>" (text) -> their indicator segment
    "exaone4_5": Exaone45Layout,  # EXAONE 4.5: Qwen2-VL's runs, 1-D positions
    "llava_onevision1_5": LlavaOnevision15Layout,  # its runs over one-frame patch rows
    "minicpmv": MiniCPMVLayout,
    "minicpmv_canvas": MiniCPMVCanvasLayout,
    "paligemma": PaliGemmaLayout,
    "mllama": MllamaLayout,  # Llama 3.2 Vision: one token an image, spanning every position
    "molmo2": Molmo2Layout,  # Molmo2: crops pooled into grids of <im_patch>, one span
    "lighton_ocr": LightOnOcrLayout,  # LightOnOCR: Pixtral's tower, plain runs (no breaks)
    "deepseek_vl": DeepseekVLLayout,  # DeepSeek-VL: LLaVA 1.5's fixed runs
    "deepseek_vl_hybrid": DeepseekVLHybridLayout,  # its run; pixels of both towers in one
    "deepseek_ocr_v1": DeepseekOCRLayout,  # DeepSeek-OCR v1: "<image>" -> its tiles' run
    "dots_ocr": Exaone45Layout,  # dots.ocr: Qwen2-VL's runs of <|imgpad|>, 1-D positions
    "deepseek_vl2": DeepseekVL2Layout,  # DeepSeek-VL2: "<image>" -> its tiles' run
    "molmo_v1": MolmoV1Layout,  # Molmo v1: each image's tiles' segment at the prompt's start
    "janus": JanusLayout,  # Janus: boi, DeepSeek-VL's fixed run, eoi
    "hyperclovax_vision_v2": Exaone45Layout,  # HyperCLOVA X Vision V2: Qwen2-VL's runs, 1-D
    "opencua": Exaone45Layout,  # OpenCUA: Qwen2-VL's runs of <|media_placeholder|>, 1-D
    "isaac": IsaacLayout,  # Isaac: "<image>" -> <|image_pad|> runs, its own M-RoPE table
    "phi4mm": Phi4MMLayout,  # Phi-4-multimodal: a run by the HD crop grid
    "phi4mm_remote": Phi4MMRemoteLayout,  # its Hub release: the same runs, numbered tags
    "aria": AriaLayout,  # Aria: a run of crops x queries, each crop its own ImageInput
    "vipllava": Layout,  # ViP-LLaVA: LLaVA 1.5's fixed run
    "llava_next_video": AnyResLayout,  # LLaVA-NeXT-Video's images: LLaVA-NeXT's
    "blip2": Blip2Layout,  # BLIP-2: a run of num_query_tokens, first when unmarked
    "chameleon": ChameleonLayout,  # Chameleon: boi, a fixed run of VQ codes, eoi
    "emu3": Emu3Layout,  # Emu3: boi, "h*w", its wrapper, rows of VQ codes + end-of-line, eof, eoi
    "fuyu": FuyuLayout,  # Fuyu: rows of patch tokens, each ended by |NEWLINE|
    "minimax_m3_vl": MiniMaxM3Layout,  # MiniMax M3: start, a run by the merged grid, end
    "minimax_vl_01": MiniMaxVL01Layout,  # MiniMax-VL-01: LLaVA-NeXT's runs, its own pixels
    "inkling2": Inkling2Layout,  # Inkling 2: a run of one token per cell, 1-D positions
    "h2ovl": H2OVLLayout,  # H2OVL-Mississippi: InternVL-Chat's, one image alone by MSAC
    "internvl_chat": InternVLChatLayout,  # the Hub's InternVL: InternVL's, tiles by its config
    "nvlm_d": NVLMLayout,  # NVLM-D: InternVL-Chat's tiles, each run after its tile tag
    "minicpm_ocr": MiniCPMOcrLayout,  # MiniCPM-OCR: MiniCPM-V 4.6's, use_image_id as saved
    "minicpmv_remote": MiniCPMVRemoteLayout,  # MiniCPM-V 2.6 / 4.5: "(<image>./</image>)"
    "qwen_vl_v1": QwenVLLayout,  # Qwen-VL v1: each <img> ... </img> span -> n_queries pads
    "nemotron_h_omni": NemotronOmniLayout,  # Nemotron-H Omni: <img>, a run by the grid, </img>
    "nemotron_nano_vl": NanoNemotronVLLayout,  # Nemotron Nano VL v2: <img>, a run by tiles, </img>
    "nemotron_vl_v1": NemotronVLV1Layout,  # Nemotron Nano VL v1: v2's runs, its own tiles
    "phi3v": Phi3VLayout,  # Phi-3(.5)-vision: "<|image_i|>" tags -> runs by the HD crop grid
    "clip_embed": DualEncoderLayout,  # CLIP embeddings: an image prompt is one placeholder
    "siglip_embed": DualEncoderLayout,  # SigLIP embeddings: the same
    "mantis": MantisLayout,  # Mantis (vLLM's name): LLaVA's runs in numbered image text
    "tarsier": TarsierLayout,  # Tarsier v1: LLaVA 1.5's run with its separator rows in it
    "glm4v_remote": Glm4vRemoteLayout,  # GLM-4V 9B: boi, pad, eoi -> boi, (grid / 2)^2 pads, eoi
    "step3_vl": Step3VLLayout,  # Step3-VL: patch runs in <patch_start> / <patch_end>, then global
}
