"""Drop-in compatibility layers for scripts written for BackPACK, Cockpit and ViViT.

Change only the imports: ``from backpack import backpack, extend`` becomes
``from backprism.compat.backpack import backpack, extend``.
"""
