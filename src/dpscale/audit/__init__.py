"""``dpscale audit``: measure, on one training run, that it leaks no more than it claims
(Steinke, Nasr & Jagielski 2023, "Privacy auditing with one (1) training run").

m canaries are made, each included in the training set independently with probability 1/2. All
of them join the training set (an excluded one as a placeholder whose gradient is zero), so N, q
and the claimed epsilon count them without depending on which are included. After the run, each canary gets a
score; the most and least confident are guessed in or out, and the number of right guesses
gives an epsilon the run provably exceeds with probability at most 1 - confidence
(``dpscale.privacy.accounting.audit_bound``). A lower bound above the claimed epsilon means the claim is
false (a bug in clipping, noise or accounting); a bound below it proves nothing about privacy:
an audit can only refute.

Two kinds of canary:

* ``gradient`` (white box, the default and far stronger): Dirac canaries. Canary i is a
  placeholder example whose per-example gradient is M e_j(i), with M = ``DIRAC_SCALE`` * C (less
  in fp16) on its own coordinate j(i) of a trainable Linear/Conv weight or bias; it is Poisson
  sampled like any example. An included canary is an example of a probe (``dpscale.audit.dirac``)
  that calls that one layer on a crafted input, and the run's engine itself differentiates,
  norms, clips and sums it, so a clipping bug in the engine lets more than C through for the
  canaries too. The auditor sees every released noisy gradient and, as DP-SGD's guarantee allows,
  everything but the canaries' membership, including the data's clipped sum; it scores canary i
  by the log-likelihood ratio of its coordinate's per-step residuals under "sampled with
  probability q, contributing C" against "absent".
* ``input`` (black box): mislabelled training images (taken out of the training set, given a
  random other label); score = the decrease of the canary's loss from the initial to the final
  model.
"""

AUDIT_KINDS = ("gradient", "input")
DEFAULT_CANARIES = 1000
DEFAULT_CONFIDENCE = 0.95
PLOT_NAME = "audit_scores.png"
