package org.orchard.device;

/**
 * The Orchard device client for the JVM and Android: a thin binding over
 * liborchard_device's C ABI (orchard_device.h), one Java method per C call.
 *
 * <p>Threads: as the C handle, an instance is used from one thread at a time, except
 * {@link #cancel()}, which any thread may call while another is inside a call. Calls
 * that talk to the server block: on Android, run them from a WorkManager worker, never
 * the main thread. Every failure is an {@link OrchardException} carrying the C status
 * and message.
 */
public final class OrchardDevice implements AutoCloseable {
  static {
    System.loadLibrary("orchard_device_jni");
  }

  /** A failed call: {@code status} is the C ABI's orchard_status, the message says why. */
  public static final class OrchardException extends Exception {
    public final int status;
    public final String statusName;

    public OrchardException(int status, String statusName, String message) {
      super(statusName + ": " + message);
      this.status = status;
      this.statusName = statusName;
    }
  }

  /** The device's state as the app reads it from the OS (orchard_device_state). */
  public static final class DeviceState {
    public double batteryPercent = Double.NaN; // 0..100; NaN: no battery
    public int charging = -1;                  // 1, 0, -1 unknown
    public double temperatureC = Double.NaN;   // NaN: unknown (thermalStatus is used)
    public int thermalStatus = -1;             // THERMAL_*; -1 unknown
    public int unmeteredNetwork = -1;          // 1 Wi-Fi, 0 metered, -1 unknown
    public int idle = -1;                      // 1 idle, 0 in use, -1 unknown
    public double energyJ = Double.NaN;        // cumulative joules; NaN: none
  }

  /** Reads the device's state; called on the thread of the call that needs it. */
  public interface StateSource {
    DeviceState read();
  }

  /** What a participation (or a local training check) did (orchard_round_report). */
  public static final class RoundReport {
    public long round;
    public boolean uploaded;
    public long numSteps;
    public long numExamples;
    public double weight;
    public double trainLoss;
    public boolean stoppedEarly;
  }

  public static final int THERMAL_NONE = 0, THERMAL_LIGHT = 1, THERMAL_MODERATE = 2, THERMAL_SEVERE = 3;

  private long handle;
  private StateSource source; // kept reachable while the C library may call it

  private OrchardDevice(long handle) {
    this.handle = handle;
  }

  /** Open and check the bundle in {@code bundleDir} (orchard_device_open). */
  public static OrchardDevice open(String bundleDir) throws OrchardException {
    return new OrchardDevice(nativeOpen(bundleDir));
  }

  public static native String version();

  public void setOption(String name, String value) throws OrchardException {
    nativeSetOption(live(), name, value);
  }

  public void setStateSource(StateSource source) throws OrchardException {
    nativeSetStateSource(live(), source);
    this.source = source;
  }

  /** 0 when the device may train now, else the INELIGIBLE bits of orchard_device.h. */
  public int checkEligibility() throws OrchardException {
    return nativeCheckEligibility(live());
  }

  public void join() throws OrchardException {
    nativeJoin(live());
  }

  public String nodeId() {
    return handle == 0 ? "" : nativeNodeId(handle);
  }

  public void setText(String text) throws OrchardException {
    // Real UTF-8 (JNI's own strings are modified UTF-8, which differs beyond the BMP).
    nativeSetText(live(), text.getBytes(java.nio.charset.StandardCharsets.UTF_8));
  }

  public RoundReport participate(double maxWaitS) throws OrchardException {
    RoundReport r = new RoundReport();
    nativeParticipate(live(), maxWaitS, r);
    return r;
  }

  public RoundReport trainLocal(long steps, long batchSize, double learningRate) throws OrchardException {
    RoundReport r = new RoundReport();
    nativeTrainLocal(live(), steps, batchSize, learningRate, r);
    return r;
  }

  /** The last call's message ("" after a success; a participation's reason for no upload). */
  public String lastMessage() {
    return handle == 0 ? "" : nativeErrmsg(handle);
  }

  /** Any thread: end the call in flight with ORCHARD_ERR_CANCELLED. */
  public void cancel() {
    long h = handle;
    if (h != 0) nativeCancel(h);
  }

  @Override
  public void close() {
    if (handle != 0) nativeClose(handle);
    handle = 0;
    source = null;
  }

  private long live() {
    if (handle == 0) throw new IllegalStateException("the OrchardDevice is closed");
    return handle;
  }

  private static native long nativeOpen(String bundleDir) throws OrchardException;
  private static native void nativeClose(long h);
  private static native String nativeErrmsg(long h);
  private static native void nativeSetOption(long h, String name, String value) throws OrchardException;
  private static native void nativeSetStateSource(long h, StateSource source) throws OrchardException;
  private static native int nativeCheckEligibility(long h) throws OrchardException;
  private static native void nativeJoin(long h) throws OrchardException;
  private static native String nativeNodeId(long h);
  private static native void nativeSetText(long h, byte[] utf8) throws OrchardException;
  private static native void nativeParticipate(long h, double maxWaitS, RoundReport out) throws OrchardException;
  private static native void nativeTrainLocal(long h, long steps, long batchSize, double learningRate, RoundReport out)
      throws OrchardException;
  private static native void nativeCancel(long h);
}
