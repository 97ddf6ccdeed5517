"""The ecosystem's formats: Hugging Face DeepseekV3 safetensors out (export, with the
tokenizer) and in (import), and sampling text from a run's checkpoint."""
