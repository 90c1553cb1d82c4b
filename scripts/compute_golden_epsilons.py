"""Golden epsilon values for DP-SGD (Poisson-subsampled Gaussian, add/remove adjacency).

Independent references for tests/test_accountant.py: Opacus' RDP accountant and Microsoft's
prv-accountant, neither of which dpscale uses. Reproduce in a scratch environment:

    python3 -m venv /tmp/golden-venv
    /tmp/golden-venv/bin/pip install -c constraints.txt opacus==1.6.0 prv-accountant==0.2.0
    /tmp/golden-venv/bin/python scripts/compute_golden_epsilons.py
"""
import json
import math
import time
import warnings

import numpy as np
from scipy.optimize import brentq
from scipy.stats import norm

from opacus.accountants import RDPAccountant, PRVAccountant as OpacusPRV
from opacus.accountants.analysis.rdp import compute_rdp
from prv_accountant import PoissonSubsampledGaussianMechanism, PRVAccountant

warnings.simplefilter("ignore")

CASES = [
    ("A", 256 / 60000, 1.1, int(60 * 60000 / 256), 1e-5),
    ("B", 256 / 60000, 1.1, int(15 * 60000 / 256), 1e-5),
    ("C", 0.01, 1.0, 300, 1e-5),
    ("D", 256 / 60000, 1.12, int(60 * 60000 / 256), 1e-5),
    ("E", 0.064, 1.5, 500, 1e-5),
    ("F", 0.001, 0.8, 10000, 1e-6),
    ("G", 1.0, 5.0, 10, 1e-5),
]
EPS_ERROR = 0.01


def opacus_rdp(q, sigma, steps, delta, alphas=None):
    acc = RDPAccountant()
    acc.history = [(sigma, q, steps)]
    return float(acc.get_epsilon(delta, alphas=alphas) if alphas else acc.get_epsilon(delta))


def classic_rdp(q, sigma, steps, delta, alphas):
    """Classic (Mironov 2017) conversion eps = min_a rdp(a) - log(delta)/(a-1)."""
    a = np.asarray(alphas, dtype=float)
    rdp = compute_rdp(q=q, noise_multiplier=sigma, steps=steps, orders=a)
    eps = rdp - math.log(delta) / (a - 1)
    i = int(np.nanargmin(eps))
    return float(eps[i]), float(a[i])


def opacus_prv(q, sigma, steps, delta):
    acc = OpacusPRV()
    acc.history = [(sigma, q, steps)]
    upper = float(acc.get_epsilon(delta, eps_error=EPS_ERROR))  # returns the UPPER bound
    # also the central estimate, via the same internal objects get_epsilon uses
    delta_error = delta / 1000
    dprv = acc._get_dprv(eps_error=EPS_ERROR, delta_error=delta_error)
    lo, est, up = dprv.compute_epsilon(delta, delta_error, EPS_ERROR)
    return float(est), upper, float(lo), float(up)


def prv_pkg(q, sigma, steps, delta):
    prv = PoissonSubsampledGaussianMechanism(noise_multiplier=sigma, sampling_probability=q)
    acc = PRVAccountant(prvs=[prv], max_self_compositions=[steps],
                        eps_error=EPS_ERROR, delta_error=delta / 1000)
    lo, est, up = acc.compute_epsilon(delta=delta, num_self_compositions=[steps])
    return float(lo), float(est), float(up)


def analytic_gaussian(sigma, steps, delta):
    """Exact eps for `steps`-fold composed Gaussian (sensitivity 1), Balle & Wang 2018."""
    s = sigma / math.sqrt(steps)  # effective noise of the single equivalent Gaussian

    def delta_of_eps(eps):
        # log-space for the second term to avoid overflow
        t1 = norm.cdf(-eps * s + 1 / (2 * s))
        t2 = math.exp(eps + norm.logcdf(-eps * s - 1 / (2 * s)))
        return t1 - t2

    return brentq(lambda e: delta_of_eps(e) - delta, 0.0, 100.0, xtol=1e-14, rtol=1e-14)


def safe(f, *a):
    try:
        return f(*a)
    except Exception as e:  # noqa
        return f"ERROR: {type(e).__name__}: {e}"


rows, extras = [], {}
for case, q, sigma, steps, delta in CASES:
    t0 = time.time()
    r = {"case": case, "sample_rate": q, "noise_multiplier": sigma, "steps": steps, "delta": delta}
    r["opacus_rdp"] = safe(opacus_rdp, q, sigma, steps, delta)
    op = safe(opacus_prv, q, sigma, steps, delta)
    if isinstance(op, tuple):
        r["opacus_prv"] = op[1]            # what opacus get_epsilon returns (upper bound)
        r["opacus_prv_estimate"] = op[0]
        r["opacus_prv_lower"] = op[2]
    else:
        r["opacus_prv"] = op
    pk = safe(prv_pkg, q, sigma, steps, delta)
    if isinstance(pk, tuple):
        r["prv_lower"], r["prv_estimate"], r["prv_upper"] = pk
    else:
        r["prv_lower"] = r["prv_estimate"] = r["prv_upper"] = pk
    r["analytic"] = analytic_gaussian(sigma, steps, delta) if case == "G" else None
    rows.append(r)
    print(case, json.dumps(r), f"({time.time()-t0:.1f}s)", flush=True)

for case, alphas in [("C", [2, 5, 10, 20, 100]), ("D", [2, 5, 10, 20, 100]), ("D", [10, 20, 100])]:
    _, q, sigma, steps, delta = next(c for c in CASES if c[0] == case)
    key = f"{case} alphas={alphas}"
    extras[key] = {
        "opacus_rdp_balle2020": opacus_rdp(q, sigma, steps, delta, alphas),
        "classic_conversion": classic_rdp(q, sigma, steps, delta, alphas),
    }
    print(key, extras[key], flush=True)

# classic conversion with opacus default alphas, all cases, for reference
for case, q, sigma, steps, delta in CASES:
    extras[f"{case} classic, default alphas"] = classic_rdp(q, sigma, steps, delta, RDPAccountant.DEFAULT_ALPHAS)
    print(case, "classic default alphas", extras[f"{case} classic, default alphas"], flush=True)

with open("golden_epsilons.json", "w") as f:
    json.dump(rows, f, indent=2)
with open("golden_epsilons_extras.json", "w") as f:
    json.dump(extras, f, indent=2)

# ---- Independent cross-check: Google dp_accounting (separate codebase; PLD + RDP) ----
import dp_accounting
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

for r in rows:
    ev = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(r["sample_rate"], dp_accounting.GaussianDpEvent(r["noise_multiplier"])),
        r["steps"])
    t0 = time.time()
    pld = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)  # add/remove (default)
    pld.compose(ev)
    r["dp_accounting_pld"] = float(pld.get_epsilon(r["delta"]))
    rdp = rdp_privacy_accountant.RdpAccountant()  # add/remove (default), its default orders
    rdp.compose(ev)
    r["dp_accounting_rdp"] = float(rdp.get_epsilon(r["delta"]))
    print(r["case"], "dp_accounting pld", r["dp_accounting_pld"], "rdp", r["dp_accounting_rdp"],
          f"({time.time()-t0:.1f}s)", flush=True)

with open("golden_epsilons.json", "w") as f:
    json.dump(rows, f, indent=2)
