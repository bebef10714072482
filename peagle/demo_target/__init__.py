"""The small demo target trained here (models/demo-target): its model shape, tokenizer, token data, trainer
(``python -m peagle.demo_target.train``, ``peagle train-target``) and evaluation (``peagle eval-target``)."""
