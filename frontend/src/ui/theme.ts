// Light / dark themes: CSS variables on :root (styles.css) selected by `data-theme`, which always
// holds the resolved theme: the user's choice, or the system preference for "system" (followed
// live). Canvases read the variables into a Palette, re-read when the theme changes.

export type ThemeChoice = "system" | "light" | "dark";

export interface Palette {
  dark: boolean;
  bg: string;
  panel: string;
  text: string;
  muted: string;
  grid: string;
  border: string;
  accent: string;
  waiting: string;
  preempted: string;
  finished: string;
  aborted: string;
  unknown: string;
  free: string;
  cached: string;
  flash: string;
  restore: string;
  drop: string;
  series: string[];
}

let version = 0;
let palette: Palette | null = null;

function cssVar(style: CSSStyleDeclaration, name: string, fallback: string): string {
  const v = style.getPropertyValue(name).trim();
  return v || fallback;
}

function systemPrefersDark(): boolean {
  return typeof matchMedia === "function" && matchMedia("(prefers-color-scheme: dark)").matches;
}

export function isDark(): boolean {
  return typeof document !== "undefined" && document.documentElement.dataset.theme === "dark";
}

export function getPalette(): Palette {
  if (palette !== null) return palette;
  const style = typeof document !== "undefined" && typeof getComputedStyle === "function"
    ? getComputedStyle(document.documentElement)
    : ({ getPropertyValue: () => "" } as unknown as CSSStyleDeclaration);
  const dark = isDark();
  palette = {
    dark,
    bg: cssVar(style, "--bg", dark ? "#0d1117" : "#f6f7f9"),
    panel: cssVar(style, "--panel", dark ? "#161b22" : "#ffffff"),
    text: cssVar(style, "--text", dark ? "#e6edf3" : "#1f2328"),
    muted: cssVar(style, "--muted", dark ? "#8b949e" : "#656d76"),
    grid: cssVar(style, "--grid", dark ? "#262c36" : "#eaecef"),
    border: cssVar(style, "--border", dark ? "#30363d" : "#d8dee4"),
    accent: cssVar(style, "--accent", "#7c5cff"),
    waiting: cssVar(style, "--state-waiting", "#8b949e"),
    preempted: cssVar(style, "--state-preempted", "#f85149"),
    finished: cssVar(style, "--state-finished", "#3fb950"),
    aborted: cssVar(style, "--state-aborted", "#db6d28"),
    unknown: cssVar(style, "--state-unknown", "#6e7681"),
    free: cssVar(style, "--block-free", dark ? "#1f252d" : "#eef1f4"),
    cached: cssVar(style, "--block-cached", dark ? "#3b4250" : "#c9d1d9"),
    flash: cssVar(style, "--block-flash", "#ffd33d"),
    restore: cssVar(style, "--block-restore", "#39c5cf"),
    drop: cssVar(style, "--block-drop", "#d2a8ff"),
    series: [1, 2, 3, 4].map((i) => cssVar(style, `--series-${i}`, ["#7c5cff", "#2da44e", "#d4a72c", "#e5534b"][i - 1]!)),
  };
  return palette;
}

export function paletteVersion(): number {
  return version;
}

function invalidate(): void {
  palette = null;
  version++;
}

export function storedTheme(): ThemeChoice {
  try {
    const v = localStorage.getItem("minivllm.theme");
    return v === "light" || v === "dark" ? v : "system";
  } catch {
    return "system";
  }
}

export function applyTheme(choice: ThemeChoice): void {
  document.documentElement.dataset.theme = choice === "system" ? (systemPrefersDark() ? "dark" : "light") : choice;
  try {
    if (choice === "system") localStorage.removeItem("minivllm.theme");
    else localStorage.setItem("minivllm.theme", choice);
  } catch {
    /* storage unavailable */
  }
  invalidate();
}

export function watchSystemTheme(): () => void {
  if (typeof matchMedia !== "function") return () => undefined;
  const mq = matchMedia("(prefers-color-scheme: dark)");
  const fn = () => {
    if (storedTheme() === "system") applyTheme("system");
  };
  mq.addEventListener("change", fn);
  return () => mq.removeEventListener("change", fn);
}
