"""The peers' spellings, kept apart from chatgen's own names: ChatLearn's config dialect and module calls
(chatlearn.py), NeMo RL's generation calls (nemo_rl.py). Users call them as before (`VLLMModule` mixes both in;
`config_dialect: chatlearn` reads a ChatLearn YAML); chatgen's core never names them.
"""
