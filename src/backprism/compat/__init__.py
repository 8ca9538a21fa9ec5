"""Drop-in compatibility layers for scripts written for BackPACK 1.7, Cockpit 1.0 and ViViT 1.0.

Change only the imports: ``from backpack import backpack, extend`` becomes
``from backprism.compat.backpack import backpack, extend``; ``from cockpit import Cockpit``
becomes ``from backprism.compat.cockpit import Cockpit``; ``from vivit.linalg.eigh import
EighComputation`` becomes ``from backprism.compat.vivit.linalg.eigh import EighComputation``.
The predecessors' deeper module paths (``backpack.extensions.firstorder.base``,
``backpack.hessianfree.ggnvp``, ``backpack.custom_module.branching``,
``backpack.core.derivatives.linear``, ``cockpit.quantities.quantity``,
``vivit.extensions.secondorder.vivit``, …) resolve under ``backprism.compat`` too.

Where backprism differs on purpose, the names still exist and behave as documented by the
predecessor, or raise an error saying what to use instead:

* BackPACK's graph conversion (``extend(..., use_converter=True)``,
  ``custom_module.graph_utils.convert_module_to_backpack``) returns the model unchanged, and
  ``backpack(..., retain_graph=...)`` needs nothing kept: backprism works on the autograd graph.
* BackPACK's custom-module API (``ModuleExtension``, ``ext.set_module_extension``) computes the
  module's parameters with the user's methods; backprism needs none of it (its generic
  ``torch.func`` rule covers any module) and refuses it where BackPACK would hand objects
  backprism does not build (Hessian family, curvature-matrix products, KFRA).
* ``core.derivatives`` classes are one generic autograd implementation under BackPACK's names.
* ``extension_hook`` runs on the modules that own parameters (BackPACK: every module).
"""
