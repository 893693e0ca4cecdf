"""A tiny full `qwen3_omni_moe` config (Thinker, Talker, code predictor, Code2Wav) for the
speech tests: transformers builds the reference from it, omniwalk loads its checkpoint."""

from transformers import Qwen3OmniMoeConfig

from test_qwen3_omni import hf_config as thinker_hf_config

CODEBOOK = 32                     # codes per codebook; the Talker's vocabulary adds 1024 specials above
SPECIAL = dict(im_start_token_id=280, im_end_token_id=281, user_token_id=282, assistant_token_id=283,
               system_token_id=284, tts_pad_token_id=285, tts_bos_token_id=286, tts_eos_token_id=287)
SPEAKERS = {"ethan": CODEBOOK + 14, "chelsie": CODEBOOK + 15, "aiden": CODEBOOK + 16}
CODEC_EOS = CODEBOOK + 10


def full_hf_config() -> Qwen3OmniMoeConfig:
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1], "mrope_interleaved": True}
    talker = dict(
        text_config=dict(vocab_size=CODEBOOK + 1024, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, moe_intermediate_size=16,
                         shared_expert_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
                         max_position_embeddings=512, rope_parameters=rope),
        code_predictor_config=dict(vocab_size=CODEBOOK, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_code_groups=4,
                                   max_position_embeddings=64),
        num_code_groups=4, thinker_hidden_size=32, accept_hidden_layer=2,
        codec_pad_id=CODEBOOK + 8, codec_bos_id=CODEBOOK + 9, codec_eos_token_id=CODEC_EOS,
        codec_nothink_id=CODEBOOK + 11, codec_think_bos_id=CODEBOOK + 12, codec_think_eos_id=CODEBOOK + 13,
        speaker_id=SPEAKERS, audio_token_id=290, image_token_id=291, video_token_id=292, vision_start_token_id=294,
        audio_start_token_id=293, position_id_per_seconds=13, spatial_merge_size=2)
    code2wav = dict(codebook_size=CODEBOOK, hidden_size=32, num_attention_heads=4, num_key_value_heads=4,
                    num_hidden_layers=2, intermediate_size=48, sliding_window=8, num_quantizers=4,
                    upsample_rates=[2, 2], upsampling_ratios=[2], decoder_dim=16, max_position_embeddings=512)
    return Qwen3OmniMoeConfig(thinker_config=thinker_hf_config().to_dict(), talker_config=talker,
                              code2wav_config=code2wav, enable_audio_output=True, **SPECIAL)
