"""Writes greenhouse_task/data/greenhouse.csv: sensor readings from six greenhouses, each
labelled with the crop's condition. Synthetic and seeded (the file is committed; this
script is how it was made): every greenhouse has its own climate and its own mix of
conditions, so its rows are a natural, non-IID client.

    python make_data.py
"""

from pathlib import Path

import numpy as np

CONDITIONS = ("healthy", "thirsty", "overheated", "nutrient_poor")
SITES = {  # name: (rows, class mix, temperature offset, humidity offset)
    "almeria": (700, (0.40, 0.25, 0.30, 0.05), 2.5, -8.0),
    "westland": (650, (0.60, 0.10, 0.05, 0.25), -2.0, 6.0),
    "murcia": (550, (0.35, 0.35, 0.25, 0.05), 2.0, -10.0),
    "ontario": (500, (0.55, 0.10, 0.10, 0.25), -3.0, 4.0),
    "hokkaido": (450, (0.50, 0.15, 0.05, 0.30), -4.0, 2.0),
    "queensland": (400, (0.30, 0.25, 0.40, 0.05), 3.5, 5.0),
}
COLUMNS = ("temperature_c", "humidity_pct", "soil_moisture", "light_klux", "co2_ppm", "ph", "ec_ms_cm")


def rows(rng: np.random.Generator, condition: int, n: int, dt: float, dh: float) -> np.ndarray:
    temp = rng.normal(24.0 + dt, 2.0, n)
    hum = rng.normal(65.0 + dh, 7.0, n)
    soil = rng.normal(0.42, 0.06, n)
    light = rng.normal(35.0, 9.0, n)
    co2 = rng.normal(800.0, 120.0, n)
    ph = rng.normal(6.2, 0.25, n)
    ec = rng.normal(2.0, 0.3, n)
    if condition == 1:  # thirsty: dry soil, drier air, stomata closed
        soil -= rng.uniform(0.12, 0.25, n)
        hum -= rng.uniform(3.0, 12.0, n)
    elif condition == 2:  # overheated: hot, bright, ventilation losing CO2
        temp += rng.uniform(5.0, 10.0, n)
        light += rng.uniform(5.0, 20.0, n)
        co2 -= rng.uniform(50.0, 250.0, n)
    elif condition == 3:  # nutrient-poor: low conductivity, pH off either way
        ec -= rng.uniform(0.6, 1.2, n)
        ph += rng.choice([-1.0, 1.0], n) * rng.uniform(0.5, 1.1, n)
    return np.stack([temp, hum, soil, light, co2, ph, ec], axis=1)


def main() -> None:
    rng = np.random.default_rng(20261128)
    lines = [",".join(("greenhouse", *COLUMNS, "condition"))]
    for site, (n, mix, dt, dh) in SITES.items():
        labels = rng.choice(len(CONDITIONS), size=n, p=mix)
        for c in range(len(CONDITIONS)):
            k = int((labels == c).sum())
            for r in rows(rng, c, k, dt, dh):
                lines.append(",".join((site, *(f"{v:.3f}" for v in r), CONDITIONS[c])))
    out = Path(__file__).parent / "greenhouse_task" / "data" / "greenhouse.csv"
    out.write_text("\n".join(lines) + "\n")
    print(f"{len(lines) - 1} rows -> {out}")


if __name__ == "__main__":
    main()
