"""Model registry: HF `architectures[0]` -> our implementation. A `*ForSequenceClassification`
(or `*ForTokenClassification`: the same head, on every token) of a registered `*ForCausalLM` is
that model with a classification head (models/sequence_classifier.py)."""

from __future__ import annotations

from torch import nn

from paged_engine.classification import causal_names
from paged_engine.models.afmoe import AfmoeForCausalLM
from paged_engine.models.apertus import ApertusForCausalLM
from paged_engine.models.apertus1p5 import Apertus1p5TextForCausalLM
from paged_engine.models.arcee import ArceeForCausalLM
from paged_engine.models.arctic import ArcticForCausalLM
from paged_engine.models.aria import AriaTextForCausalLM
from paged_engine.models.axk1 import AXK1ForCausalLM
from paged_engine.models.axk2 import AXK2ForCausalLM
from paged_engine.models.baichuan import BaichuanForCausalLM
from paged_engine.models.bailing_hybrid import BailingHybridForCausalLM
from paged_engine.models.bailing_moe import BailingMoeForCausalLM
from paged_engine.models.bamba import BambaForCausalLM
from paged_engine.models.bart import BartForConditionalGeneration
from paged_engine.models.base_model import base_model_class
from paged_engine.models.beam import BeamForCausalLM
from paged_engine.models.bert import ENCODERS
from paged_engine.models.biogpt import BioGptForCausalLM
from paged_engine.models.bitnet import BitNetForCausalLM
from paged_engine.models.bloom import BloomForCausalLM
from paged_engine.models.chameleon import ChameleonForCausalLM
from paged_engine.models.chatglm import ChatGLMForCausalLM
from paged_engine.models.codegen import CodeGenForCausalLM
from paged_engine.models.cohere import (
    Cohere2ForCausalLM,
    Cohere2MoeForCausalLM,
    CohereForCausalLM,
)
from paged_engine.models.cohere_asr import CohereAsrForConditionalGeneration
from paged_engine.models.cohere_compass import CohereCompassForCausalLM
from paged_engine.models.cosmos3_edge import Cosmos3EdgeTextForCausalLM
from paged_engine.models.dbrx import DbrxForCausalLM
from paged_engine.models.decilm import DeciLMForCausalLM
from paged_engine.models.deepseek_ocr2_text import DeepseekOcr2TextForCausalLM
from paged_engine.models.deepseek_v1 import DeepseekForCausalLM
from paged_engine.models.deepseek_v2 import (
    DeepseekV2ForCausalLM,
    DeepseekV3ForCausalLM,
    Glm4MoeLiteForCausalLM,
)
from paged_engine.models.deepseek_v4 import DeepseekV4ForCausalLM
from paged_engine.models.deepseek_v32 import DeepseekV32ForCausalLM, GlmMoeDsaForCausalLM
from paged_engine.models.diffllama import DiffLlamaForCausalLM
from paged_engine.models.doge import DogeForCausalLM
from paged_engine.models.dory import DoryForCausalLM
from paged_engine.models.dots1 import Dots1ForCausalLM
from paged_engine.models.dots3_note import Dots3NoteForCausalLM
from paged_engine.models.dual_encoder_text import CLIPEmbeddingModel, SiglipEmbeddingModel
from paged_engine.models.embedding_gemma2 import EmbeddingGemma2TextModel
from paged_engine.models.ergo import ErgoForCausalLM
from paged_engine.models.ernie4_5 import Ernie4_5ForCausalLM
from paged_engine.models.ernie4_5_moe import Ernie4_5_MoeForCausalLM
from paged_engine.models.ernie4_5_vl_moe import Ernie4_5_VLMoeTextForCausalLM
from paged_engine.models.exaone4 import Exaone4ForCausalLM
from paged_engine.models.exaone_moe import ExaoneMoeForCausalLM, HYV3ForCausalLM
from paged_engine.models.falcon import FalconForCausalLM
from paged_engine.models.falcon_h1 import FalconH1ForCausalLM
from paged_engine.models.flint import FlintForCausalLM
from paged_engine.models.gemma import GemmaForCausalLM, VaultGemmaForCausalLM
from paged_engine.models.gemma2 import Gemma2ForCausalLM
from paged_engine.models.gemma3 import Gemma3ForCausalLM
from paged_engine.models.gemma3n import Gemma3nForCausalLM
from paged_engine.models.gemma4 import Gemma4ForCausalLM
from paged_engine.models.gemma4_unified import Gemma4UnifiedForCausalLM
from paged_engine.models.glm4 import Glm4ForCausalLM, GlmForCausalLM
from paged_engine.models.glm4_moe import Glm4MoeForCausalLM, SolarOpenForCausalLM
from paged_engine.models.glm5_next import Glm5NextTextForCausalLM
from paged_engine.models.gpt2 import GPT2LMHeadModel
from paged_engine.models.gpt_bigcode import GPTBigCodeForCausalLM
from paged_engine.models.gpt_neo import GPTNeoForCausalLM
from paged_engine.models.gpt_neox import GPTNeoXForCausalLM
from paged_engine.models.gpt_oss import GptOssForCausalLM
from paged_engine.models.gptj import GPTJForCausalLM
from paged_engine.models.granite import GraniteForCausalLM, GraniteSWAForCausalLM
from paged_engine.models.granitemoe import GraniteMoeForCausalLM
from paged_engine.models.granitemoe_swa import GraniteMoeSWAForCausalLM
from paged_engine.models.granitemoehybrid import GraniteMoeHybridForCausalLM
from paged_engine.models.granitemoeshared import GraniteMoeSharedForCausalLM
from paged_engine.models.gritlm import GRITLM
from paged_engine.models.grok1 import Grok1ForCausalLM
from paged_engine.models.gte import GTE
from paged_engine.models.hunyuan import HunYuanDenseV1ForCausalLM, HunYuanMoEV1ForCausalLM
from paged_engine.models.hunyuan_vl import HunYuanVLTextForCausalLM
from paged_engine.models.hy_v4 import HYV4ForCausalLM
from paged_engine.models.hy_v4_vl import HYV4VLTextForCausalLM
from paged_engine.models.hyperclovax import HyperCLOVAXForCausalLM
from paged_engine.models.inkling import InklingForCausalLM
from paged_engine.models.inkling2 import Inkling2ForCausalLM, Inkling2LoopForCausalLM
from paged_engine.models.internlm2_ve import InternLM2VEForCausalLM
from paged_engine.models.internlm3 import InternLM3ForCausalLM
from paged_engine.models.jais import JAISLMHeadModel
from paged_engine.models.jamba import JambaForCausalLM
from paged_engine.models.jetmoe import JetMoeForCausalLM
from paged_engine.models.jina_embeddings_v3 import JINA_EMBEDDINGS_V3
from paged_engine.models.jina_vl_ranker import JinaVLForSequenceClassification
from paged_engine.models.kimi_linear import KimiLinearForCausalLM
from paged_engine.models.kolibri import Kolibri1_1ForCausalLM, Kolibri1ForCausalLM
from paged_engine.models.laguna import LagunaForCausalLM, MellumForCausalLM
from paged_engine.models.lara_mini import LaraMiniForCausalLM
from paged_engine.models.lfm2 import Lfm2ForCausalLM, Lfm2MoeForCausalLM, Lfm3ForCausalLM
from paged_engine.models.llama import LlamaForCausalLM
from paged_engine.models.llama4 import Llama4ForCausalLM
from paged_engine.models.llama_bidirectional import LLAMA_BIDIRECTIONAL
from paged_engine.models.llama_remote import (
    Fairseq2LlamaForCausalLM,
    PanguEmbeddedForCausalLM,
    TeleFLMForCausalLM,
)
from paged_engine.models.llama_variants import (
    CwmForCausalLM,
    ExaoneForCausalLM,
    InternLM2ForCausalLM,
    InternLMForCausalLM,
    MiMoForCausalLM,
    MiniCPMForCausalLM,
)
from paged_engine.models.longcat_flash import LongcatFlashForCausalLM
from paged_engine.models.mamba import (
    FalconMambaForCausalLM,
    Mamba2ForCausalLM,
    MambaForCausalLM,
)
from paged_engine.models.mimo_v2_flash import MiMoV2FlashForCausalLM
from paged_engine.models.minicpm3 import MiniCPM3ForCausalLM
from paged_engine.models.minicpm5_moe import MiniCPM5MoeForCausalLM
from paged_engine.models.minimax import MiniMaxForCausalLM
from paged_engine.models.minimax_m2 import MiniMaxM2ForCausalLM
from paged_engine.models.minimax_m3 import MiniMaxM3ForCausalLM
from paged_engine.models.ministral3 import Ministral3ForCausalLM
from paged_engine.models.mistral import MistralForCausalLM
from paged_engine.models.mistral4 import Mistral4ForCausalLM
from paged_engine.models.mistral_large4 import MistralLarge4TextForCausalLM
from paged_engine.models.mixtral import MixtralForCausalLM
from paged_engine.models.mllama import MllamaForConditionalGeneration
from paged_engine.models.modernbert import MODERNBERT
from paged_engine.models.molmo2 import Molmo2TextForCausalLM
from paged_engine.models.molmo_v1 import MolmoV1TextForCausalLM
from paged_engine.models.molmoe import MolmoeTextForCausalLM
from paged_engine.models.moonshine import MoonshineForConditionalGeneration
from paged_engine.models.mpt import MptForCausalLM
from paged_engine.models.muse import MuseGlimmerTextForCausalLM, MuseSparkTextForCausalLM
from paged_engine.models.nanochat import NanoChatForCausalLM
from paged_engine.models.nemotron import Jais2ForCausalLM, NemotronForCausalLM
from paged_engine.models.nemotron_h import NemotronHForCausalLM
from paged_engine.models.nomic_bert import NOMIC_BERT
from paged_engine.models.olmo import OlmoForCausalLM
from paged_engine.models.olmo2 import Olmo2ForCausalLM
from paged_engine.models.olmo3 import Olmo3ForCausalLM
from paged_engine.models.olmo_hybrid import OlmoHybridForCausalLM
from paged_engine.models.olmoe import FlexOlmoForCausalLM, OlmoeForCausalLM
from paged_engine.models.openpangu_moe import PanguProMoEV2ForCausalLM, PanguUltraMoEForCausalLM
from paged_engine.models.opt import OPTForCausalLM
from paged_engine.models.orion import OrionForCausalLM
from paged_engine.models.ouro import OuroForCausalLM
from paged_engine.models.paddleocr_vl import PaddleOCRTextForCausalLM
from paged_engine.models.pangu_pro_moe import PanguProMoEForCausalLM
from paged_engine.models.persimmon import PersimmonForCausalLM
from paged_engine.models.phi import PhiForCausalLM
from paged_engine.models.phi3 import Phi3ForCausalLM
from paged_engine.models.phimoe import PhimoeForCausalLM
from paged_engine.models.plamo2 import Plamo2ForCausalLM
from paged_engine.models.plamo3 import Plamo3ForCausalLM
from paged_engine.models.qwen2 import Qwen2ForCausalLM
from paged_engine.models.qwen2_moe import Qwen2MoeForCausalLM
from paged_engine.models.qwen3 import Qwen3ForCausalLM
from paged_engine.models.qwen3_moe import Qwen3MoeForCausalLM
from paged_engine.models.qwen3_next import (
    Qwen3_5ForCausalLM,
    Qwen3_5MoeForCausalLM,
    Qwen3NextForCausalLM,
)
from paged_engine.models.qwen4_exp import Qwen4ExpForCausalLM
from paged_engine.models.qwen_v1 import QWenLMHeadModel
from paged_engine.models.recurrent_gemma import RecurrentGemmaForCausalLM
from paged_engine.models.reward_model import REWARD_CLASSES
from paged_engine.models.seed_oss import SeedOssForCausalLM
from paged_engine.models.sequence_classifier import sequence_classifier
from paged_engine.models.smollm3 import SmolLM3ForCausalLM
from paged_engine.models.solar import SolarForCausalLM
from paged_engine.models.splade import SPLADE
from paged_engine.models.stablelm import StableLmForCausalLM
from paged_engine.models.starcoder2 import Starcoder2ForCausalLM
from paged_engine.models.step3_text import Step3TextForCausalLM
from paged_engine.models.step3p7 import Step3p7TextForCausalLM
from paged_engine.models.telechat2 import TeleChat2ForCausalLM
from paged_engine.models.transformers_backend.selection import IMPL_FIELD
from paged_engine.models.voxtral_realtime import VoxtralRealtimeTextForCausalLM
from paged_engine.models.voyage import VOYAGE
from paged_engine.models.whisper import WhisperForConditionalGeneration
from paged_engine.models.xglm import XGLMForCausalLM
from paged_engine.models.youtu import YoutuForCausalLM
from paged_engine.models.zamba import ZambaForCausalLM
from paged_engine.models.zamba2 import Zamba2ForCausalLM
from paged_engine.models.zaya import ZayaForCausalLM
from paged_engine.multimodal.donut import DonutForConditionalGeneration
from paged_engine.multimodal.florence2 import Florence2ForConditionalGeneration

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Molmo2TextForCausalLM": Molmo2TextForCausalLM,
    "MolmoV1TextForCausalLM": MolmoV1TextForCausalLM,  # Molmo v1's (remote code)
    "MolmoeTextForCausalLM": MolmoeTextForCausalLM,  # MolmoE-1B's (remote code)
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "OPTForCausalLM": OPTForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
    "GPTNeoXForCausalLM": GPTNeoXForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "GemmaForCausalLM": GemmaForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM,
    "GraniteSWAForCausalLM": GraniteSWAForCausalLM,
    "HyperCLOVAXForCausalLM": HyperCLOVAXForCausalLM,
    "ExaoneForCausalLM": ExaoneForCausalLM,
    "InternLMForCausalLM": InternLMForCausalLM,
    "CwmForCausalLM": CwmForCausalLM,
    "MiMoForCausalLM": MiMoForCausalLM,
    "MiMoV2FlashForCausalLM": MiMoV2FlashForCausalLM,
    "InternLM2ForCausalLM": InternLM2ForCausalLM,
    "InternLM2VEForCausalLM": InternLM2VEForCausalLM,  # Mono-InternVL's LLM
    "MiniCPMForCausalLM": MiniCPMForCausalLM,
    # Llama itself under other names (vLLM's registry maps them to its Llama)
    "LLaMAForCausalLM": LlamaForCausalLM,
    "AquilaForCausalLM": LlamaForCausalLM,
    "AquilaModel": LlamaForCausalLM,
    "XverseForCausalLM": LlamaForCausalLM,
    "Emu3ForCausalLM": LlamaForCausalLM,  # Emu3's text decoder (emu3_text_model): Llama
    "AfmoeForCausalLM": AfmoeForCausalLM,
    "BeamForCausalLM": BeamForCausalLM,
    "ErgoForCausalLM": ErgoForCausalLM,
    "MuseGlimmerTextForCausalLM": MuseGlimmerTextForCausalLM,
    "MuseSparkTextForCausalLM": MuseSparkTextForCausalLM,
    "DoryForCausalLM": DoryForCausalLM,
    "BitNetForCausalLM": BitNetForCausalLM,
    "LagunaForCausalLM": LagunaForCausalLM,
    "MellumForCausalLM": MellumForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "SmolLM3ForCausalLM": SmolLM3ForCausalLM,
    "Olmo3ForCausalLM": Olmo3ForCausalLM,
    "Ministral3ForCausalLM": Ministral3ForCausalLM,
    "Glm4MoeForCausalLM": Glm4MoeForCausalLM,
    "SolarOpenForCausalLM": SolarOpenForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "Glm4MoeLiteForCausalLM": Glm4MoeLiteForCausalLM,
    "DeepseekOcr2TextForCausalLM": DeepseekOcr2TextForCausalLM,  # DeepSeek-OCR-2's decoder
    "DeepseekV32ForCausalLM": DeepseekV32ForCausalLM,
    "DeepseekV4ForCausalLM": DeepseekV4ForCausalLM,
    "GlmMoeDsaForCausalLM": GlmMoeDsaForCausalLM,
    "HYV4ForCausalLM": HYV4ForCausalLM,
    "HYV4VLTextForCausalLM": HYV4VLTextForCausalLM,
    "Cosmos3EdgeTextForCausalLM": Cosmos3EdgeTextForCausalLM,
    "Step3p7TextForCausalLM": Step3p7TextForCausalLM,
    "LongcatFlashForCausalLM": LongcatFlashForCausalLM,
    "MiniCPM3ForCausalLM": MiniCPM3ForCausalLM,
    "YoutuForCausalLM": YoutuForCausalLM,
    "AXK1ForCausalLM": AXK1ForCausalLM,
    "AXK2ForCausalLM": AXK2ForCausalLM,
    "MiniCPM5MoeForCausalLM": MiniCPM5MoeForCausalLM,
    "MiniCPM5MoEForCausalLM": MiniCPM5MoeForCausalLM,  # the release's config.json spelling
    "Mistral4ForCausalLM": Mistral4ForCausalLM,
    "MistralLarge4TextForCausalLM": MistralLarge4TextForCausalLM,
    "GraniteMoeForCausalLM": GraniteMoeForCausalLM,
    "GraniteMoeSharedForCausalLM": GraniteMoeSharedForCausalLM,
    "AriaTextForCausalLM": AriaTextForCausalLM,
    "GraniteMoeSWAForCausalLM": GraniteMoeSWAForCausalLM,
    "Ernie4_5ForCausalLM": Ernie4_5ForCausalLM,
    "Ernie4_5_ForCausalLM": Ernie4_5ForCausalLM,  # older releases' config.json spelling
    "Ernie4_5_MoeForCausalLM": Ernie4_5_MoeForCausalLM,
    "SeedOssForCausalLM": SeedOssForCausalLM,
    "Starcoder2ForCausalLM": Starcoder2ForCausalLM,
    "StableLmForCausalLM": StableLmForCausalLM,
    "PhiForCausalLM": PhiForCausalLM,
    "PersimmonForCausalLM": PersimmonForCausalLM,
    "JetMoeForCausalLM": JetMoeForCausalLM,
    "Glm4ForCausalLM": Glm4ForCausalLM,
    "GlmForCausalLM": GlmForCausalLM,
    "HeliumForCausalLM": GlmForCausalLM,
    "OlmoForCausalLM": OlmoForCausalLM,
    "MinistralForCausalLM": MistralForCausalLM,
    "PhimoeForCausalLM": PhimoeForCausalLM,
    "NanoChatForCausalLM": NanoChatForCausalLM,
    "Gemma4ForCausalLM": Gemma4ForCausalLM,
    "Gemma4UnifiedForCausalLM": Gemma4UnifiedForCausalLM,
    "Gemma3nForCausalLM": Gemma3nForCausalLM,
    "Llama4ForCausalLM": Llama4ForCausalLM,
    "GPTNeoForCausalLM": GPTNeoForCausalLM,
    "VaultGemmaForCausalLM": VaultGemmaForCausalLM,
    "CohereForCausalLM": CohereForCausalLM,
    "Cohere2ForCausalLM": Cohere2ForCausalLM,
    "Cohere2MoeForCausalLM": Cohere2MoeForCausalLM,
    "CohereCompassForCausalLM": CohereCompassForCausalLM,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM,
    "Qwen4ExpForCausalLM": Qwen4ExpForCausalLM,
    "GraniteMoeHybridForCausalLM": GraniteMoeHybridForCausalLM,
    "NemotronHForCausalLM": NemotronHForCausalLM,
    "Lfm2ForCausalLM": Lfm2ForCausalLM,
    "Lfm2MoeForCausalLM": Lfm2MoeForCausalLM,
    "Lfm3ForCausalLM": Lfm3ForCausalLM,
    "FalconH1ForCausalLM": FalconH1ForCausalLM,
    "KimiLinearForCausalLM": KimiLinearForCausalLM,
    "BailingHybridForCausalLM": BailingHybridForCausalLM,
    "BailingMoeForCausalLM": BailingMoeForCausalLM,  # Ling v1 (remote code)
    "BailingMoeV2ForCausalLM": BailingMoeForCausalLM,  # Ling / Ring 2.0 (remote code)
    "Glm5NextTextForCausalLM": Glm5NextTextForCausalLM,
    "InklingForCausalLM": InklingForCausalLM,
    "Inkling2ForCausalLM": Inkling2ForCausalLM,
    "Inkling2LoopForCausalLM": Inkling2LoopForCausalLM,
    "OlmoHybridForCausalLM": OlmoHybridForCausalLM,
    "BambaForCausalLM": BambaForCausalLM,
    "MambaForCausalLM": MambaForCausalLM,
    "FalconMambaForCausalLM": FalconMambaForCausalLM,
    "Mamba2ForCausalLM": Mamba2ForCausalLM,
    "JambaForCausalLM": JambaForCausalLM,
    "Zamba2ForCausalLM": Zamba2ForCausalLM,
    "ZambaForCausalLM": ZambaForCausalLM,  # Zamba v1: Mamba (v1) heads, one shared block
    "RecurrentGemmaForCausalLM": RecurrentGemmaForCausalLM,  # Griffin: RG-LRU + local attn
    "ZayaForCausalLM": ZayaForCausalLM,
    "Exaone4ForCausalLM": Exaone4ForCausalLM,
    "ApertusForCausalLM": ApertusForCausalLM,
    "Apertus1p5TextForCausalLM": Apertus1p5TextForCausalLM,
    "ArceeForCausalLM": ArceeForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
    "FlexOlmoForCausalLM": FlexOlmoForCausalLM,
    "MiniMaxForCausalLM": MiniMaxForCausalLM,
    "MiniMaxText01ForCausalLM": MiniMaxForCausalLM,  # the releases' own model code
    "MiniMaxM1ForCausalLM": MiniMaxForCausalLM,
    "MiniMaxM2ForCausalLM": MiniMaxM2ForCausalLM,
    "MiniMaxM3VLForCausalLM": MiniMaxM3ForCausalLM,
    "HunYuanDenseV1ForCausalLM": HunYuanDenseV1ForCausalLM,
    "HunYuanVLTextForCausalLM": HunYuanVLTextForCausalLM,  # HunyuanOCR's, multi-axis rope
    "PaddleOCRTextForCausalLM": PaddleOCRTextForCausalLM,  # PaddleOCR-VL's, NeoX M-RoPE
    # ERNIE 4.5 VL's: text / vision experts by token, its 3-D rope
    "Ernie4_5_VLMoeTextForCausalLM": Ernie4_5_VLMoeTextForCausalLM,
    "HunYuanMoEV1ForCausalLM": HunYuanMoEV1ForCausalLM,
    "Dots1ForCausalLM": Dots1ForCausalLM,
    "Dots3NoteForCausalLM": Dots3NoteForCausalLM,
    "DiffLlamaForCausalLM": DiffLlamaForCausalLM,
    "DogeForCausalLM": DogeForCausalLM,
    "GPTBigCodeForCausalLM": GPTBigCodeForCausalLM,
    "FalconForCausalLM": FalconForCausalLM,
    "BloomForCausalLM": BloomForCausalLM,
    "MptForCausalLM": MptForCausalLM,
    "GPTJForCausalLM": GPTJForCausalLM,
    "CodeGenForCausalLM": CodeGenForCausalLM,
    "BioGptForCausalLM": BioGptForCausalLM,
    "XGLMForCausalLM": XGLMForCausalLM,
    "NemotronForCausalLM": NemotronForCausalLM,
    "Jais2ForCausalLM": Jais2ForCausalLM,
    "DbrxForCausalLM": DbrxForCausalLM,
    "InternLM3ForCausalLM": InternLM3ForCausalLM,
    "ExaoneMoeForCausalLM": ExaoneMoeForCausalLM,
    "HYV3ForCausalLM": HYV3ForCausalLM,
    "Kolibri1ForCausalLM": Kolibri1ForCausalLM,
    "Kolibri1_1ForCausalLM": Kolibri1_1ForCausalLM,
    "FlintForCausalLM": FlintForCausalLM,
    "LaraMiniForCausalLM": LaraMiniForCausalLM,
    "ChameleonForCausalLM": ChameleonForCausalLM,  # Chameleon's decoder (qk-norm, swin_norm)
    # encoder-decoder: audio in, text out (worker/cross_attention.py)
    "WhisperForConditionalGeneration": WhisperForConditionalGeneration,
    "MoonshineForConditionalGeneration": MoonshineForConditionalGeneration,
    "CohereAsrForConditionalGeneration": CohereAsrForConditionalGeneration,
    # encoder-decoder: text in, text out (models/bart.py; BartModel as vLLM 0.10 serves it)
    "BartForConditionalGeneration": BartForConditionalGeneration,
    "BartModel": BartForConditionalGeneration,
    "MBartForConditionalGeneration": BartForConditionalGeneration,
    # BART with a DaViT image tower in front of its encoder (multimodal/florence2.py)
    "Florence2ForConditionalGeneration": Florence2ForConditionalGeneration,
    # Donut: a Swin tower's rows cross-attended by an mBART decoder (multimodal/donut.py;
    # VisionEncoderDecoderModel only as donut-swin + mbart, others refused by name)
    "DonutForConditionalGeneration": DonutForConditionalGeneration,
    "VisionEncoderDecoderModel": DonutForConditionalGeneration,
    # Llama 3.2 Vision: a decoder cross-attending to its images (worker/cross_attention.py)
    "MllamaForConditionalGeneration": MllamaForConditionalGeneration,
    **ENCODERS,  # BERT / RoBERTa encoders: embeddings and cross-encoders (models/bert.py)
    **MODERNBERT,  # ModernBERT: the same, with rotary and windowed attention
    **GTE,  # GTE v1.5 / multilingual (Hub's NewModel): rotary post-norm encoders (gte.py)
    **NOMIC_BERT,  # nomic-embed-text v1 / v1.5: the same stack, SwiGLU (nomic_bert.py)
    **JINA_EMBEDDINGS_V3,  # jina-embeddings-v3: the same stack, task LoRA merged at load
    # CLIPModel's / SiglipModel's text towers (text_wrappers.py; images: multimodal/dual_encoder.py)
    "CLIPEmbeddingModel": CLIPEmbeddingModel,
    "SiglipEmbeddingModel": SiglipEmbeddingModel,
    **SPLADE,  # BERT masked-LM checkpoints pooled into SPLADE sparse vectors (splade.py)
    **LLAMA_BIDIRECTIONAL,  # llama-nemotron-embed: Llama run bidirectionally (remote config)
    **GRITLM,  # GritLM-7B's embedder: Llama run bidirectionally, pooled after the instruction
    **VOYAGE,  # Voyage AI's embedders: Qwen3 run bidirectionally, a linear head (voyage.py)
    # EmbeddingGemma 2's text encoder (models/embedding_gemma2.py; its wrapper: text_wrappers.py)
    "EmbeddingGemma2TextModel": EmbeddingGemma2TextModel,
    # remote-code releases: ChatGLM2 / 3 and GLM-4 under their own names (GLM's model),
    # Nemotron-NAS (Llama with per-layer heads / widths / skipped parts), Orion (LayerNorms)
    "ChatGLMModel": ChatGLMForCausalLM,
    "ChatGLMForConditionalGeneration": ChatGLMForCausalLM,
    "DeciLMForCausalLM": DeciLMForCausalLM,
    "OrionForCausalLM": OrionForCausalLM,
    # remote-code releases under vLLM's names (configs translated: models/remote_aliases.py)
    "MPTForCausalLM": MptForCausalLM,
    "PhiMoEForCausalLM": PhimoeForCausalLM,
    "RWForCausalLM": FalconForCausalLM,
    "StableLMEpochForCausalLM": StableLmForCausalLM,
    "QWenLMHeadModel": QWenLMHeadModel,
    "BaichuanForCausalLM": BaichuanForCausalLM,
    "BaiChuanForCausalLM": BaichuanForCausalLM,
    "TeleChat2ForCausalLM": TeleChat2ForCausalLM,
    "TeleChatForCausalLM": TeleChat2ForCausalLM,
    # jina-reranker-m0's decoder and score head (its wrapper JinaVLForRanking: text_wrappers.py)
    "JinaVLForSequenceClassification": JinaVLForSequenceClassification,
    # remote-code Llama releases: Tele-FLM's muP scalars, openPangu-Embedded's biases,
    # fairseq2's names and rotary order (models/llama_remote.py)
    "TeleFLMForCausalLM": TeleFLMForCausalLM,
    "PanguEmbeddedForCausalLM": PanguEmbeddedForCausalLM,
    "Fairseq2LlamaForCausalLM": Fairseq2LlamaForCausalLM,
    # remote-code MoE releases: DeepSeek-MoE v1 (Llama attention, shared experts), Snowflake
    # Arctic (a dense residual MLP beside the MoE) (models/deepseek_v1.py, arctic.py)
    "DeepseekForCausalLM": DeepseekForCausalLM,
    "ArcticForCausalLM": ArcticForCausalLM,
    # xAI's Grok-1 (remote code): four norms a layer, soft caps, a GELU MoE (models/grok1.py)
    "Grok1ModelForCausalLM": Grok1ForCausalLM,
    "Grok1ForCausalLM": Grok1ForCausalLM,
    # remote-code releases: Upstage Solar Pro (Llama with block skip connections), ByteDance
    # Ouro (a looped stack, one KV cache per loop step and layer) (models/solar.py, ouro.py)
    "SolarForCausalLM": SolarForCausalLM,
    "OuroForCausalLM": OuroForCausalLM,
    # JAIS v1 (remote code): GPT-2 with SwiGLU, ALiBi or learned positions, muP scalars
    "JAISLMHeadModel": JAISLMHeadModel,
    # PLaMo 2 (remote code): Mamba-style mixers among sliding-window attention (models/plamo2.py)
    "Plamo2ForCausalLM": Plamo2ForCausalLM,
    # PLaMo 3 (remote code): sliding-window and full attention, sandwich norms (models/plamo3.py)
    "Plamo3ForCausalLM": Plamo3ForCausalLM,
    # Huawei Pangu Pro MoE (remote code): MoGE, grouped top-1 routing with a router scale, and
    # a shared expert (models/pangu_pro_moe.py)
    "PanguProMoEForCausalLM": PanguProMoEForCausalLM,
    # openPangu Ultra MoE / Pro MoE V2 (remote code): DeepSeek-V3's MLA and MoE with sigmoid
    # top-k routing and sandwich norms (models/openpangu_moe.py)
    "PanguUltraMoEForCausalLM": PanguUltraMoEForCausalLM,
    "PanguProMoEV2ForCausalLM": PanguProMoEV2ForCausalLM,
    # StepFun Step3 (remote code): MFA attention (a shared low-rank query, one KV head) and
    # MoE layers with a shared expert (models/step3_text.py; the VL release: text_wrappers.py)
    "Step3TextForCausalLM": Step3TextForCausalLM,
    # Voxtral Realtime's decoder: Mistral, its delay conditioning folded in its norms
    # (models/voxtral_realtime.py)
    "VoxtralRealtimeTextForCausalLM": VoxtralRealtimeTextForCausalLM,
}


# model_type -> the class whatever `architectures` says: transformers serves these types with
# a class of another family (EXAONE 3's with its Llama) and saves that class's name beside the
# release's tensor names.
BY_MODEL_TYPE: dict[str, type[nn.Module]] = {"exaone": ExaoneForCausalLM}


def get_model_class(hf_config) -> type[nn.Module]:
    """The class for `hf_config.architectures[0]`; ValueError listing the supported ones."""
    if getattr(hf_config, IMPL_FIELD, None) == "transformers":  # engine.select_model_impl
        from paged_engine.models.transformers_backend.pooling import transformers_model_class

        return transformers_model_class(hf_config)  # causal LM, embedding model or classifier
    archs = list(getattr(hf_config, "architectures", None) or [])
    own = BY_MODEL_TYPE.get(getattr(hf_config, "model_type", None))
    if own is not None and all(arch.endswith("ForCausalLM") for arch in archs):
        return own
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
        for name in causal_names(arch):
            if name in MODEL_REGISTRY:
                return sequence_classifier(MODEL_REGISTRY[name])
        if arch in REWARD_CLASSES:  # Qwen2 / InternLM2 reward models (models/reward_model.py)
            return REWARD_CLASSES[arch]
        base = base_model_class(hf_config, arch, MODEL_REGISTRY)  # <Stem>Model: embeddings
        if base is not None:
            return base
    supported = ", ".join(sorted(MODEL_REGISTRY))
    got = ", ".join(archs) if archs else "none (config.architectures is empty)"
    raise ValueError(
        f"unsupported model architecture: {got}. Supported: {supported}, and the "
        "*ForSequenceClassification and *ForTokenClassification of each *ForCausalLM among them, "
        "its base <Stem>Model (embeddings), Qwen2ForRewardModel, Qwen2ForProcessRewardModel "
        "and InternLM2ForRewardModel"
    )


def kv_cache_layout(hf_config) -> list[tuple[int, int]] | None:
    """(num_kv_heads, head_dim) of each KV-cached layer, for a model whose layers cache
    differently (its class's `kv_cache_layout`: Gemma 4); None where one shape serves all."""
    try:
        cls = get_model_class(hf_config)
    except ValueError:
        return None
    layout = getattr(cls, "kv_cache_layout", None)
    return None if layout is None else layout(hf_config)


__all__ = ["MODEL_REGISTRY", "get_model_class", "kv_cache_layout"]
