"""The small demo target trained here (models/demo-target): its model shape, tokenizer, token data, trainer
(``python -m lab.demo_target.train``) and evaluation (``python -m lab.demo_target.evaluate_target``).  Lab code:
nothing in the ``peagle`` package imports it."""
