"""config.json of multimodal, pooling and encoder-decoder releases as their authors published
them (nested vision / text configs with every odd field), and `shrink_vlm`, which makes a tiny
model of one on a tiny checkpoint's processor by changing only size fields and token ids."""

from __future__ import annotations

import copy
import json
from typing import Any

from release_configs import CONFIGS_DIR, _remap_token_ids, shrink

# the size fields a nested text config may leave to its class's defaults: shrink needs them
_TEXT_SIZES = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "max_position_embeddings")  # fmt: skip
# a vision tower's size fields: the tiny checkpoint's (its processor cuts images by them)
_VISION_SIZES = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "image_size", "patch_size", "projection_dim", "depth", "embed_dim", "num_heads",
                 "window_size", "fullatt_block_indexes", "mlp_ratio", "head_dim",
                 "deepstack_visual_indexes", "num_position_embeddings", "num_image_tokens",
                 "num_positions", "attention_heads", "num_global_layers",
                 "intermediate_layers_indices", "vision_output_dim", "max_num_tiles",
                 "supported_aspect_ratios")  # fmt: skip
# the wrapper's fields that follow the tiny tower and processor
_TOP_SIZES = ("mm_tokens_per_image", "image_grid_pinpoints")
_QWEN_VL = {
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "vision_token_id": 151654,
    "image_token_id": 151655,
    "video_token_id": 151656,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.41.2",
    "use_cache": True,
    "use_sliding_window": False,
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
}
_QWEN25_VISION = {
    "depth": 32,
    "hidden_act": "silu",
    "hidden_size": 1280,
    "intermediate_size": 3420,
    "num_heads": 16,
    "in_chans": 3,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "spatial_patch_size": 14,
    "window_size": 112,
    "fullatt_block_indexes": [7, 15, 23, 31],
    "tokens_per_second": 2,
    "temporal_patch_size": 2,
}

# name -> the release's config.json
VLMS: dict[str, dict[str, Any]] = {
    "llava-1.5-7b-hf": {
        "architectures": ["LlavaForConditionalGeneration"],
        "ignore_index": -100,
        "image_token_index": 32000,
        "model_type": "llava",
        "pad_token_id": 32001,
        "projector_hidden_act": "gelu",
        "text_config": {
            "_name_or_path": "lmsys/vicuna-7b-v1.5",
            "architectures": ["LlamaForCausalLM"],
            "max_position_embeddings": 4096,
            "model_type": "llama",
            "rms_norm_eps": 1e-05,
            "torch_dtype": "float16",
            "vocab_size": 32064,
        },
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        "transformers_version": "4.36.0.dev0",
        "vision_config": {
            "hidden_size": 1024,
            "image_size": 336,
            "intermediate_size": 4096,
            "model_type": "clip_vision_model",
            "num_attention_heads": 16,
            "num_hidden_layers": 24,
            "patch_size": 14,
            "projection_dim": 768,
            "vocab_size": 32000,
        },
        "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default",
        "vocab_size": 32064,
    },
    "qwen2-vl-2b-instruct": {
        **_QWEN_VL,
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "max_position_embeddings": 32768,
        "max_window_layers": 28,
        "model_type": "qwen2_vl",
        "num_attention_heads": 12,
        "num_hidden_layers": 28,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
        "vision_config": {
            "depth": 32,
            "embed_dim": 1280,
            "mlp_ratio": 4,
            "num_heads": 16,
            "in_chans": 3,
            "hidden_size": 1536,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "spatial_patch_size": 14,
            "temporal_patch_size": 2,
        },
        "vocab_size": 151936,
    },
    "qwen2.5-vl-3b-instruct": {
        **_QWEN_VL,
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "hidden_size": 2048,
        "intermediate_size": 11008,
        "max_position_embeddings": 128000,
        "max_window_layers": 70,
        "model_type": "qwen2_5_vl",
        "num_attention_heads": 16,
        "num_hidden_layers": 36,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
        "vision_config": {**_QWEN25_VISION, "out_hidden_size": 2048},
        "vocab_size": 151936,
    },
    "qwen2.5-vl-7b-instruct": {
        **_QWEN_VL,
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "max_position_embeddings": 128000,
        "max_window_layers": 28,
        "model_type": "qwen2_5_vl",
        "num_attention_heads": 28,
        "num_hidden_layers": 28,
        "num_key_value_heads": 4,
        "tie_word_embeddings": False,
        "vision_config": {**_QWEN25_VISION, "out_hidden_size": 3584},
        "vocab_size": 152064,
    },
    "gemma-3-4b-it": {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "boi_token_index": 255999,
        "eoi_token_index": 256000,
        "eos_token_id": [1, 106],
        "image_token_index": 262144,
        "initializer_range": 0.02,
        "mm_tokens_per_image": 256,
        "model_type": "gemma3",
        "text_config": {
            "hidden_size": 2560,
            "intermediate_size": 10240,
            "model_type": "gemma3_text",
            "num_hidden_layers": 34,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024,
        },
        "torch_dtype": "bfloat16",
        "transformers_version": "4.50.0.dev0",
        "vision_config": {
            "hidden_size": 1152,
            "image_size": 896,
            "intermediate_size": 4304,
            "model_type": "siglip_vision_model",
            "num_attention_heads": 16,
            "num_hidden_layers": 27,
            "patch_size": 14,
            "vision_use_head": False,
        },
    },
    "llava-v1.6-mistral-7b-hf": {
        "architectures": ["LlavaNextForConditionalGeneration"],
        "ignore_index": -100,
        "image_grid_pinpoints": [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]],
        "image_token_index": 32000,
        "model_type": "llava_next",
        "projector_hidden_act": "gelu",
        "text_config": {
            "_name_or_path": "mistralai/Mistral-7B-Instruct-v0.2",
            "architectures": ["MistralForCausalLM"],
            "intermediate_size": 14336,
            "max_position_embeddings": 32768,
            "model_type": "mistral",
            "num_key_value_heads": 8,
            "rms_norm_eps": 1e-05,
            "rope_theta": 1000000.0,
            "sliding_window": None,
            "torch_dtype": "bfloat16",
            "vocab_size": 32064,
        },
        "torch_dtype": "float16",
        "transformers_version": "4.39.0.dev0",
        "use_image_newline_parameter": True,
        "vision_config": {
            "hidden_size": 1024,
            "image_size": 336,
            "intermediate_size": 4096,
            "model_type": "clip_vision_model",
            "num_attention_heads": 16,
            "num_hidden_layers": 24,
            "patch_size": 14,
            "projection_dim": 768,
            "vocab_size": 32000,
        },
        "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default",
        "vocab_size": 32064,
    },
    "mistral-small-3.1-24b-instruct-2503": {
        "architectures": ["Mistral3ForConditionalGeneration"],
        "image_token_index": 10,
        "model_type": "mistral3",
        "multimodal_projector_bias": False,
        "projector_hidden_act": "gelu",
        "spatial_merge_size": 2,
        "text_config": {
            "attention_dropout": 0.0,
            "head_dim": 128,
            "hidden_act": "silu",
            "hidden_size": 5120,
            "initializer_range": 0.02,
            "intermediate_size": 32768,
            "max_position_embeddings": 131072,
            "model_type": "mistral",
            "num_attention_heads": 32,
            "num_hidden_layers": 40,
            "num_key_value_heads": 8,
            "rms_norm_eps": 1e-05,
            "rope_theta": 1000000000.0,
            "sliding_window": None,
            "use_cache": True,
            "vocab_size": 131072,
        },
        "torch_dtype": "bfloat16",
        "transformers_version": "4.50.0.dev0",
        "vision_config": {
            "attention_dropout": 0.0,
            "head_dim": 64,
            "hidden_act": "silu",
            "hidden_size": 1024,
            "image_size": 1540,
            "initializer_range": 0.02,
            "intermediate_size": 4096,
            "model_type": "pixtral",
            "num_attention_heads": 16,
            "num_channels": 3,
            "num_hidden_layers": 24,
            "patch_size": 14,
            "rope_theta": 10000.0,
        },
        "vision_feature_layer": -1,
    },
    "pixtral-12b": {
        "architectures": ["LlavaForConditionalGeneration"],
        "ignore_index": -100,
        "image_seq_length": 1,
        "image_token_index": 10,
        "model_type": "llava",
        "projector_hidden_act": "gelu",
        "text_config": {
            "hidden_act": "silu",
            "hidden_size": 5120,
            "head_dim": 128,
            "intermediate_size": 14336,
            "is_composition": True,
            "max_position_embeddings": 1024000,
            "model_type": "mistral",
            "num_hidden_layers": 40,
            "num_key_value_heads": 8,
            "rms_norm_eps": 1e-05,
            "rope_theta": 1000000000.0,
            "sliding_window": None,
            "vocab_size": 131072,
        },
        "torch_dtype": "bfloat16",
        "transformers_version": "4.47.0.dev0",
        "vision_config": {
            "head_dim": 64,
            "hidden_act": "gelu",
            "image_size": 1024,
            "is_composition": True,
            "model_type": "pixtral",
            "patch_size": 16,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
        },
        "vision_feature_layer": -1,
        "vision_feature_select_strategy": "full",
    },
    "qwen3-vl-4b-instruct": {
        "architectures": ["Qwen3VLForConditionalGeneration"],
        "image_token_id": 151655,
        "model_type": "qwen3_vl",
        "text_config": {
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": 151643,
            "dtype": "bfloat16",
            "eos_token_id": 151645,
            "head_dim": 128,
            "hidden_act": "silu",
            "hidden_size": 2560,
            "initializer_range": 0.02,
            "intermediate_size": 9728,
            "max_position_embeddings": 262144,
            "model_type": "qwen3_vl_text",
            "num_attention_heads": 32,
            "num_hidden_layers": 36,
            "num_key_value_heads": 8,
            "rms_norm_eps": 1e-06,
            "rope_scaling": {
                "mrope_interleaved": True,
                "mrope_section": [24, 20, 20],
                "rope_type": "default",
            },
            "rope_theta": 5000000,
            "tie_word_embeddings": True,
            "use_cache": True,
            "vocab_size": 151936,
        },
        "tie_word_embeddings": True,
        "transformers_version": "4.57.0.dev0",
        "video_token_id": 151656,
        "vision_config": {
            "deepstack_visual_indexes": [5, 11, 17],
            "depth": 24,
            "hidden_act": "gelu_pytorch_tanh",
            "hidden_size": 1024,
            "in_channels": 3,
            "initializer_range": 0.02,
            "intermediate_size": 4096,
            "model_type": "qwen3_vl",
            "num_heads": 16,
            "num_position_embeddings": 2304,
            "out_hidden_size": 2560,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        "vision_end_token_id": 151653,
        "vision_start_token_id": 151652,
    },
    "paligemma2-3b-pt-224": {
        "_vocab_size": 257152,
        "architectures": ["PaliGemmaForConditionalGeneration"],
        "bos_token_id": 2,
        "eos_token_id": 1,
        "hidden_size": 2048,
        "image_token_index": 257152,
        "model_type": "paligemma",
        "pad_token_id": 0,
        "projection_dim": 2304,
        "text_config": {
            "architectures": ["Gemma2ForCausalLM"],
            "attn_logit_softcapping": 50.0,
            "cache_implementation": "hybrid",
            "eos_token_id": [1, 107],
            "final_logit_softcapping": 30.0,
            "hidden_act": "gelu_pytorch_tanh",
            "hidden_activation": "gelu_pytorch_tanh",
            "hidden_size": 2304,
            "intermediate_size": 9216,
            "model_type": "gemma2",
            "num_hidden_layers": 26,
            "num_image_tokens": 256,
            "num_key_value_heads": 4,
            "query_pre_attn_scalar": 256,
            "sliding_window": 4096,
            "torch_dtype": "bfloat16",
            "vocab_size": 257216,
        },
        "torch_dtype": "bfloat16",
        "transformers_version": "4.47.0.dev0",
        "vision_config": {
            "hidden_size": 1152,
            "intermediate_size": 4304,
            "model_type": "siglip_vision_model",
            "num_attention_heads": 16,
            "num_hidden_layers": 27,
            "num_image_tokens": 256,
            "num_positions": 256,
            "patch_size": 14,
            "projection_dim": 2304,
            "torch_dtype": "bfloat16",
            "vision_use_head": False,
        },
    },
    "smolvlm-256m-instruct": {
        "architectures": ["Idefics3ForConditionalGeneration"],
        "image_token_id": 49190,
        "model_type": "idefics3",
        "pad_token_id": 128002,
        "scale_factor": 4,
        "text_config": {
            "_flash_attn_2_enabled": True,
            "architectures": ["VLlama3ForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "head_dim": 64,
            "hidden_act": "silu",
            "hidden_size": 576,
            "initializer_range": 0.041666666666666664,
            "intermediate_size": 1536,
            "is_llama_config": True,
            "max_position_embeddings": 8192,
            "mlp_bias": False,
            "model_type": "llama",
            "neftune_noise_alpha": 0.0,
            "num_attention_heads": 9,
            "num_hidden_layers": 30,
            "num_key_value_heads": 3,
            "pad_token_id": 2,
            "perceiver_config": {
                "model_type": "vllama3",
                "resampler_depth": 3,
                "resampler_n_latents": 64,
            },
            "pixel_shuffle_factor": 4,
            "pretraining_tp": 1,
            "qk_layer_norms": False,
            "rms_norm_eps": 1e-05,
            "rope_interleaved": False,
            "rope_scaling": None,
            "rope_theta": 100000,
            "torch_dtype": "bfloat16",
            "transformers.js_config": {"kv_cache_dtype": {"fp16": "float16", "q4f16": "float16"}},
            "use_resampler": False,
            "vocab_size": 49280,
        },
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.50.0.dev0",
        "use_cache": True,
        "vision_config": {
            "hidden_size": 768,
            "image_size": 512,
            "intermediate_size": 3072,
            "max_image_size": {"longest_edge": 512},
            "model_type": "idefics3_vision",
            "num_attention_heads": 12,
            "num_hidden_layers": 12,
            "patch_size": 16,
            "size": {"longest_edge": 2048},
            "tie_word_embeddings": False,
            "use_base_siglip": False,
        },
        "vocab_size": 49280,
    },
    # (its text_config as transformers 4.45 dumped it: PretrainedConfig's generation defaults)
    "llama-3.2-11b-vision-instruct": {
        "architectures": ["MllamaForConditionalGeneration"],
        "image_token_index": 128256,
        "model_type": "mllama",
        "text_config": {
            "_name_or_path": "",
            "add_cross_attention": False,
            "architectures": None,
            "bad_words_ids": None,
            "begin_suppress_tokens": None,
            "bos_token_id": 128000,
            "chunk_size_feed_forward": 0,
            "cross_attention_hidden_size": None,
            "cross_attention_layers": [3, 8, 13, 18, 23, 28, 33, 38],
            "decoder_start_token_id": None,
            "diversity_penalty": 0.0,
            "do_sample": False,
            "dropout": 0,
            "early_stopping": False,
            "encoder_no_repeat_ngram_size": 0,
            "eos_token_id": [128001, 128008, 128009],
            "exponential_decay_length_penalty": None,
            "finetuning_task": None,
            "forced_bos_token_id": None,
            "forced_eos_token_id": None,
            "hidden_act": "silu",
            "hidden_size": 4096,
            "id2label": {"0": "LABEL_0", "1": "LABEL_1"},
            "initializer_range": 0.02,
            "intermediate_size": 14336,
            "is_decoder": False,
            "is_encoder_decoder": False,
            "label2id": {"LABEL_0": 0, "LABEL_1": 1},
            "length_penalty": 1.0,
            "max_length": 20,
            "max_position_embeddings": 131072,
            "min_length": 0,
            "model_type": "mllama_text_model",
            "no_repeat_ngram_size": 0,
            "num_attention_heads": 32,
            "num_beam_groups": 1,
            "num_beams": 1,
            "num_hidden_layers": 40,
            "num_key_value_heads": 8,
            "num_return_sequences": 1,
            "output_attentions": False,
            "output_hidden_states": False,
            "output_scores": False,
            "pad_token_id": 128004,
            "prefix": None,
            "problem_type": None,
            "pruned_heads": {},
            "remove_invalid_values": False,
            "repetition_penalty": 1.0,
            "return_dict": True,
            "return_dict_in_generate": False,
            "rms_norm_eps": 1e-05,
            "rope_scaling": {
                "factor": 8.0,
                "high_freq_factor": 4.0,
                "low_freq_factor": 1.0,
                "original_max_position_embeddings": 8192,
                "rope_type": "llama3",
            },
            "rope_theta": 500000.0,
            "sep_token_id": None,
            "suppress_tokens": None,
            "task_specific_params": None,
            "temperature": 1.0,
            "tf_legacy_loss": False,
            "tie_encoder_decoder": False,
            "tie_word_embeddings": False,
            "tokenizer_class": None,
            "top_k": 50,
            "top_p": 1.0,
            "torch_dtype": "bfloat16",
            "torchscript": False,
            "typical_p": 1.0,
            "use_bfloat16": False,
            "use_cache": True,
            "vocab_size": 128256,
        },
        "torch_dtype": "bfloat16",
        "transformers_version": "4.45.0.dev0",
        "vision_config": {
            "attention_heads": 16,
            "hidden_act": "gelu",
            "hidden_size": 1280,
            "image_size": 560,
            "initializer_range": 0.02,
            "intermediate_layers_indices": [3, 7, 15, 23, 30],
            "intermediate_size": 5120,
            "max_length": 20,
            "max_num_tiles": 4,
            "model_type": "mllama_vision_model",
            "norm_eps": 1e-05,
            "num_channels": 3,
            "num_global_layers": 8,
            "num_hidden_layers": 32,
            "patch_size": 14,
            "supported_aspect_ratios": [
                [1, 1],
                [1, 2],
                [1, 3],
                [1, 4],
                [2, 1],
                [2, 2],
                [3, 1],
                [4, 1],
            ],
            "torch_dtype": "bfloat16",
            "vision_output_dim": 7680,
        },
    },
    "internvl3-1b-hf": {
        "architectures": ["InternVLForConditionalGeneration"],
        "downsample_ratio": 0.5,
        "image_seq_length": 256,
        "image_token_id": 151667,
        "model_type": "internvl",
        "projector_hidden_act": "gelu",
        "text_config": {
            "architectures": ["Qwen2ForCausalLM"],
            "attention_dropout": 0.0,
            "bos_token_id": 151643,
            "eos_token_id": 151645,
            "hidden_act": "silu",
            "hidden_size": 896,
            "initializer_range": 0.02,
            "intermediate_size": 4864,
            "layer_types": ["full_attention"] * 24,
            "max_position_embeddings": 32768,
            "max_window_layers": 70,
            "model_type": "qwen2",
            "num_attention_heads": 14,
            "num_hidden_layers": 24,
            "num_key_value_heads": 2,
            "rms_norm_eps": 1e-06,
            "rope_scaling": None,
            "rope_theta": 1000000.0,
            "sliding_window": None,
            "torch_dtype": "bfloat16",
            "use_cache": True,
            "use_sliding_window": False,
            "vocab_size": 151674,
        },
        "torch_dtype": "bfloat16",
        "transformers_version": "4.52.0.dev0",
        "vision_config": {
            "architectures": ["InternVisionModel"],
            "attention_bias": True,
            "attention_dropout": 0.0,
            "dropout": 0.0,
            "hidden_act": "gelu",
            "hidden_dropout_prob": 0.0,
            "hidden_size": 1024,
            "image_size": [448, 448],
            "initializer_factor": 0.1,
            "initializer_range": 1e-10,
            "intermediate_size": 4096,
            "layer_norm_eps": 1e-06,
            "layer_scale_init_value": 0.1,
            "model_type": "internvl_vision",
            "norm_type": "layer_norm",
            "num_attention_heads": 16,
            "num_channels": 3,
            "num_hidden_layers": 24,
            "patch_size": [14, 14],
            "projection_dropout": 0.0,
            "torch_dtype": "bfloat16",
            "use_absolute_position_embeddings": True,
            "use_mask_token": False,
            "use_mean_pooling": True,
            "use_qk_norm": False,
        },
        "vision_feature_layer": -1,
        "vision_feature_select_strategy": "default",
    },
    "aya-vision-8b": {
        "adapter_layer_norm_eps": 1e-06,
        "architectures": ["AyaVisionForConditionalGeneration"],
        "downsample_factor": 2,
        "image_token_index": 255036,
        "model_type": "aya_vision",
        "text_config": {
            "architectures": ["Cohere2ForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": 5,
            "cache_implementation": "hybrid",
            "eos_token_id": 255001,
            "head_dim": 128,
            "hidden_act": "silu",
            "hidden_size": 4096,
            "initializer_range": 0.02,
            "intermediate_size": 14336,
            "layer_norm_eps": 1e-05,
            "logit_scale": 0.25,
            "max_position_embeddings": 16384,
            "model_type": "cohere2",
            "num_attention_heads": 32,
            "num_hidden_layers": 32,
            "num_key_value_heads": 8,
            "order_of_interleaved_layers": "local_attn_first",
            "pad_token_id": 0,
            "position_embedding_type": "rope_gptj",
            "rope_scaling": None,
            "rope_theta": 50000,
            "rotary_pct": 1.0,
            "sliding_window": 4096,
            "sliding_window_pattern": 4,
            "torch_dtype": "float16",
            "use_cache": True,
            "use_embedding_sharing": True,
            "use_gated_activation": True,
            "vocab_size": 256000,
        },
        "torch_dtype": "float16",
        "transformers_version": "4.50.0.dev0",
        "vision_config": {
            "hidden_act": "gelu_pytorch_tanh",
            "hidden_size": 1152,
            "image_size": 364,
            "intermediate_size": 4304,
            "layer_norm_eps": 1e-06,
            "model_type": "siglip_vision_model",
            "num_attention_heads": 16,
            "num_hidden_layers": 27,
            "patch_size": 14,
            "vision_use_head": False,
        },
        "vision_feature_layer": -1,
        "vision_feature_select_strategy": "full",
    },
}


def vlm_release(name: str) -> dict[str, Any]:
    return copy.deepcopy(VLMS[name])


def shrink_vlm(c: dict[str, Any], tiny: dict[str, Any]) -> dict[str, Any]:
    """Release `c` made tiny on the tiny checkpoint config `tiny` (same family): the text
    model by `shrink` (sizes a nested text config leaves to its class's defaults written out
    first), the vocabulary and image / vision token ids the tiny tokenizer's, the vision
    tower's size fields the tiny tower's (its processor's patches); every other field as
    released."""
    import transformers

    c = copy.deepcopy(c)
    vocab = tiny.get("text_config", tiny).get("vocab_size") or tiny["vocab_size"]
    vision = c.pop("vision_config")
    if "text_config" in c:
        text = c["text_config"]
        defaults = transformers.AutoConfig.for_model(text["model_type"]).to_dict()
        missing = {k: defaults[k] for k in _TEXT_SIZES if k not in text and defaults.get(k)}
        c["text_config"] = shrink({**text, **missing})
        c["text_config"]["vocab_size"] = vocab
        if "cross_attention_layers" in text:  # Mllama's: the tiny one's layers
            tiny_text = tiny["text_config"]
            for key in ("num_hidden_layers", "cross_attention_layers"):
                c["text_config"][key] = tiny_text[key]
            if text["vocab_size"] == c["image_token_index"]:  # the image id past the head's rows
                c["text_config"]["vocab_size"] = tiny["image_token_index"]
        hidden = c["text_config"]["hidden_size"]
    else:  # Qwen2-VL: the text model's fields at the top
        c = shrink(c)
        hidden = c["hidden_size"]
    if "vocab_size" in c:
        c["vocab_size"] = vocab
    tiny_vision = tiny["vision_config"]
    if "hidden_size" not in vision:  # Pixtral-12B's: the tower's sizes are its class's defaults
        vision |= {k: tiny_vision[k] for k in _VISION_SIZES[:4]}
    if "image_size" not in vision and "image_size" in tiny_vision:  # PaliGemma's: 224 default
        vision["image_size"] = tiny_vision["image_size"]
    for key in _VISION_SIZES:
        if key in vision and key in tiny_vision:
            vision[key] = tiny_vision[key]
    if "spatial_patch_size" in vision:
        vision["spatial_patch_size"] = vision["patch_size"]
    if "out_hidden_size" in vision:  # Qwen2.5-VL's merger writes the text width
        vision["out_hidden_size"] = hidden
    elif "embed_dim" in vision:  # Qwen2-VL's merger: hidden_size is the text width
        vision["hidden_size"] = hidden
    c["vision_config"] = vision
    if c["model_type"] == "paligemma":  # the projector writes the text width
        c["projection_dim"] = vision["projection_dim"] = hidden
        tokens = (vision["image_size"] // vision["patch_size"]) ** 2
        vision["num_image_tokens"] = vision["num_positions"] = tokens
        c["text_config"]["num_image_tokens"] = tokens
        # the window past the prompt's bidirectional prefix, as the release's 4096 is past its
        # 256 image rows (paged refuses a prefix longer than the window)
        c["text_config"]["sliding_window"] = 64
    for key in _TOP_SIZES:
        if key in c and key in tiny:
            c[key] = tiny[key]
    if c["model_type"] == "aya_vision":  # the projector's width, left to its class's default
        c["alignment_intermediate_size"] = tiny["alignment_intermediate_size"]
    _remap_token_ids(c)  # bos / eos / pad (lists kept)
    spare = iter(range(500, 0, -1))  # below the ids shrink moved to the tiny vocab's top
    for key in [k for k in c if k.endswith(("_token_id", "_token_index"))]:
        if key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            continue
        if key in tiny:
            c[key] = tiny[key]
        elif isinstance(c[key], int) and c[key] >= vocab:
            c[key] = next(spare)
    return c


# what shrink_vlm / shrink_encoder / shrink_enc_dec may change (besides token ids and sizes a
# release leaves to defaults, which they add)
_CHANGED = {*_TEXT_SIZES, *_VISION_SIZES, *_TOP_SIZES, "vocab_size", "rope_scaling",
            "sliding_window", "max_window_layers", "layer_types", "spatial_patch_size",
            "out_hidden_size", "projection_dim", "cross_attention_layers", "local_attention",
            "alignment_intermediate_size", "d_model", "encoder_layers", "decoder_layers",
            "encoder_attention_heads", "decoder_attention_heads", "encoder_ffn_dim",
            "decoder_ffn_dim", "num_mel_bins", "max_source_positions", "begin_suppress_tokens",
            "num_image_tokens", "num_positions"}  # fmt: skip


def assert_only_sizes_changed(full: dict[str, Any], tiny: dict[str, Any], where: str = "") -> None:
    """Every field of the release `full` is in `tiny`, as released unless a size or token id."""
    for key, value in full.items():
        assert key in tiny, f"{where}{key} dropped"
        if isinstance(value, dict) and key.endswith("_config"):
            assert_only_sizes_changed(value, tiny[key], f"{where}{key}.")
        elif tiny[key] != value:
            ids = key.endswith(("_token_id", "_token_index", "_token_ids"))
            assert key in _CHANGED or ids, f"{where}{key}: {value!r} -> {tiny[key]!r}"


_BERT = {
    "attention_probs_dropout_prob": 0.1,
    "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1,
    "id2label": {"0": "LABEL_0"},
    "initializer_range": 0.02,
    "label2id": {"LABEL_0": 0},
    "layer_norm_eps": 1e-12,
    "max_position_embeddings": 512,
    "model_type": "bert",
    "pad_token_id": 0,
    "position_embedding_type": "absolute",
    "type_vocab_size": 2,
    "use_cache": True,
    "vocab_size": 30522,
}
_XLMR_M3 = {
    "_name_or_path": "BAAI/bge-m3",
    "attention_probs_dropout_prob": 0.1,
    "bos_token_id": 0,
    "classifier_dropout": None,
    "eos_token_id": 2,
    "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1,
    "hidden_size": 1024,
    "initializer_range": 0.02,
    "intermediate_size": 4096,
    "layer_norm_eps": 1e-05,
    "max_position_embeddings": 8194,
    "model_type": "xlm-roberta",
    "num_attention_heads": 16,
    "num_hidden_layers": 24,
    "output_past": True,
    "pad_token_id": 1,
    "position_embedding_type": "absolute",
    "torch_dtype": "float32",
    "type_vocab_size": 1,
    "use_cache": True,
    "vocab_size": 250002,
}
# name -> the release's config.json (pooling models: embedders and cross-encoders)
POOLERS: dict[str, dict[str, Any]] = {
    "bge-base-en-v1.5": {
        **_BERT,
        "_name_or_path": "/root/.cache/torch/sentence_transformers/BAAI_bge-base-en/",
        "architectures": ["BertModel"],
        "classifier_dropout": None,
        "gradient_checkpointing": False,
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_attention_heads": 12,
        "num_hidden_layers": 12,
        "torch_dtype": "float32",
        "transformers_version": "4.30.0",
    },
    "bge-m3": {**_XLMR_M3, "architectures": ["XLMRobertaModel"], "transformers_version": "4.33.0"},
    "bge-reranker-v2-m3": {
        **_XLMR_M3,
        "architectures": ["XLMRobertaForSequenceClassification"],
        "id2label": {"0": "LABEL_0"},
        "label2id": {"LABEL_0": 0},
        "transformers_version": "4.38.1",
    },
    "ms-marco-minilm-l-6-v2": {
        **_BERT,
        "_name_or_path": "nreimers/MiniLM-L6-H384-uncased",
        "architectures": ["BertForSequenceClassification"],
        "gradient_checkpointing": False,
        "hidden_size": 384,
        "intermediate_size": 1536,
        "num_attention_heads": 12,
        "num_hidden_layers": 6,
        "sbert_ce_default_activation_function": "torch.nn.modules.linear.Identity",
        "transformers_version": "4.6.0",
    },
    "gte-modernbert-base": {
        "_name_or_path": "Alibaba-NLP/gte-modernbert-base",
        "architectures": ["ModernBertModel"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 50281,
        "classifier_activation": "gelu",
        "classifier_bias": False,
        "classifier_dropout": 0.0,
        "classifier_pooling": "mean",
        "cls_token_id": 50281,
        "decoder_bias": True,
        "deterministic_flash_attn": False,
        "embedding_dropout": 0.0,
        "eos_token_id": 50282,
        "global_attn_every_n_layers": 3,
        "global_rope_theta": 160000.0,
        "gradient_checkpointing": False,
        "hidden_activation": "gelu",
        "hidden_size": 768,
        "initializer_cutoff_factor": 2.0,
        "initializer_range": 0.02,
        "intermediate_size": 1152,
        "layer_norm_eps": 1e-05,
        "local_attention": 128,
        "local_rope_theta": 10000.0,
        "max_position_embeddings": 8192,
        "mlp_bias": False,
        "mlp_dropout": 0.0,
        "model_type": "modernbert",
        "norm_bias": False,
        "norm_eps": 1e-05,
        "num_attention_heads": 12,
        "num_hidden_layers": 22,
        "pad_token_id": 50283,
        "position_embedding_type": "absolute",
        "sep_token_id": 50282,
        "torch_dtype": "float32",
        "transformers_version": "4.48.0",
        "vocab_size": 50368,
    },
}

_QWEN3_06B = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "model_type": "qwen3",
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151669,
}
# causal LMs served as poolers (Qwen3-Embedding: last-token pooling by its sentence-transformers
# files; Qwen3-Reranker: vLLM's hf_overrides, the "no" / "yes" rows of its LM head)
CAUSAL_POOLERS: dict[str, dict[str, Any]] = {
    "qwen3-embedding-0.6b": {
        **_QWEN3_06B,
        "eos_token_id": 151643,
        "max_position_embeddings": 32768,
        "transformers_version": "4.51.3",
    },
    "qwen3-reranker-0.6b": {
        **_QWEN3_06B,
        "eos_token_id": 151645,
        "transformers_version": "4.51.0",
    },
}


def shrink_encoder(c: dict[str, Any]) -> dict[str, Any]:
    """A pooling release made tiny by `shrink` (ModernBERT's local window 8 tokens, its
    [CLS] id remapped as its BOS is)."""
    c = shrink(c)
    if "local_attention" in c:
        c["local_attention"] = 8
    if "cls_token_id" in c:
        c["cls_token_id"] = c["bos_token_id"]
    return c


# name -> the release's config.json (encoder-decoder generators; whisper-large-v3's is
# benchmarks/configs/whisper-large-v3/config.json)
ENC_DEC: dict[str, dict[str, Any]] = {
    "bart-large-cnn": {
        "_num_labels": 3,
        "activation_dropout": 0.0,
        "activation_function": "gelu",
        "add_final_layer_norm": False,
        "architectures": ["BartForConditionalGeneration"],
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "d_model": 1024,
        "decoder_attention_heads": 16,
        "decoder_ffn_dim": 4096,
        "decoder_layerdrop": 0.0,
        "decoder_layers": 12,
        "decoder_start_token_id": 2,
        "dropout": 0.1,
        "early_stopping": True,
        "encoder_attention_heads": 16,
        "encoder_ffn_dim": 4096,
        "encoder_layerdrop": 0.0,
        "encoder_layers": 12,
        "eos_token_id": 2,
        "force_bos_token_to_be_generated": True,
        "forced_bos_token_id": 0,
        "forced_eos_token_id": 2,
        "gradient_checkpointing": False,
        "id2label": {"0": "LABEL_0", "1": "LABEL_1", "2": "LABEL_2"},
        "init_std": 0.02,
        "is_encoder_decoder": True,
        "label2id": {"LABEL_0": 0, "LABEL_1": 1, "LABEL_2": 2},
        "length_penalty": 2.0,
        "max_length": 142,
        "max_position_embeddings": 1024,
        "min_length": 56,
        "model_type": "bart",
        "no_repeat_ngram_size": 3,
        "normalize_before": False,
        "num_beams": 4,
        "num_hidden_layers": 12,
        "output_past": True,
        "pad_token_id": 1,
        "prefix": " ",
        "scale_embedding": False,
        "task_specific_params": {
            "summarization": {
                "early_stopping": True,
                "length_penalty": 2.0,
                "max_length": 142,
                "min_length": 56,
                "no_repeat_ngram_size": 3,
                "num_beams": 4,
            }
        },
        "transformers_version": "4.7.0.dev0",
        "vocab_size": 50264,
    },
    "mbart-large-50": {
        "_name_or_path": "/home/suraj/projects/mbart-50/hf_models/mbart-50-large",
        "_num_labels": 3,
        "activation_dropout": 0.0,
        "activation_function": "gelu",
        "add_bias_logits": False,
        "add_final_layer_norm": True,
        "architectures": ["MBartForConditionalGeneration"],
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "classif_dropout": 0.0,
        "classifier_dropout": 0.0,
        "d_model": 1024,
        "decoder_attention_heads": 16,
        "decoder_ffn_dim": 4096,
        "decoder_layerdrop": 0.0,
        "decoder_layers": 12,
        "decoder_start_token_id": 2,
        "dropout": 0.1,
        "early_stopping": True,
        "encoder_attention_heads": 16,
        "encoder_ffn_dim": 4096,
        "encoder_layerdrop": 0.0,
        "encoder_layers": 12,
        "eos_token_id": 2,
        "forced_eos_token_id": 2,
        "gradient_checkpointing": False,
        "id2label": {"0": "LABEL_0", "1": "LABEL_1", "2": "LABEL_2"},
        "init_std": 0.02,
        "is_encoder_decoder": True,
        "label2id": {"LABEL_0": 0, "LABEL_1": 1, "LABEL_2": 2},
        "max_length": 200,
        "max_position_embeddings": 1024,
        "model_type": "mbart",
        "normalize_before": True,
        "normalize_embedding": True,
        "num_beams": 5,
        "num_hidden_layers": 12,
        "output_past": True,
        "pad_token_id": 1,
        "scale_embedding": True,
        "static_position_embeddings": False,
        "tokenizer_class": "MBart50Tokenizer",
        "transformers_version": "4.4.0.dev0",
        "use_cache": True,
        "vocab_size": 250054,
    },
}
_ENC_DEC_SIZES = {"d_model": 32, "encoder_layers": 2, "decoder_layers": 2,
                  "num_hidden_layers": 2, "encoder_attention_heads": 4,
                  "decoder_attention_heads": 4, "encoder_ffn_dim": 64,
                  "decoder_ffn_dim": 64}  # fmt: skip


def enc_dec_release(name: str) -> dict[str, Any]:
    if name == "whisper-large-v3":
        return json.loads((CONFIGS_DIR / name / "config.json").read_text())
    return copy.deepcopy(ENC_DEC[name])


def shrink_enc_dec(c: dict[str, Any], vocab: int, **sizes: Any) -> dict[str, Any]:
    """An encoder-decoder release made tiny: widths, layers and heads, the vocabulary `vocab`
    (special ids past the tiny vocab moved to its top, Whisper's suppressed EOS with them),
    `sizes` (Whisper's mel bins and audio positions: its feature extractor's)."""
    c = copy.deepcopy(c)
    c |= {k: v for k, v in _ENC_DEC_SIZES.items() if k in c} | sizes
    eos = c["eos_token_id"]
    _remap_token_ids(c)
    if "begin_suppress_tokens" in c:
        c["begin_suppress_tokens"] = [
            c["eos_token_id"] if t == eos else t for t in c["begin_suppress_tokens"]
        ]
    c["vocab_size"] = vocab
    return c
